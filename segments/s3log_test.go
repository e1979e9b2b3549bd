package segments_test

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"testing"

	"github.com/aws/smithy-go/logging"

	"github.com/capper-dev/capper/segments"
)

// TestS3ClientLogsThroughSlog: the AWS SDK's own lines go through slog's
// default logger (the worker's JSON stream), never as plain text of their own.
func TestS3ClientLogsThroughSlog(t *testing.T) {
	var buf bytes.Buffer
	prev := slog.Default()
	slog.SetDefault(slog.New(slog.NewJSONHandler(&buf, nil)))
	t.Cleanup(func() { slog.SetDefault(prev) })
	c, err := segments.NewS3Client(context.Background(), segments.S3Config{Endpoint: "http://127.0.0.1:1", Region: "us-east-1"})
	if err != nil {
		t.Fatal(err)
	}
	c.Options().Logger.Logf(logging.Warn, "Response has no supported checksum. Not validating response payload.")
	var line map[string]any
	if err := json.Unmarshal(bytes.TrimSpace(buf.Bytes()), &line); err != nil {
		t.Fatalf("the SDK's line is not one JSON line: %v\n%s", err, buf.String())
	}
	if line["level"] != "WARN" || line["component"] != "aws" || line["msg"] != "Response has no supported checksum. Not validating response payload." {
		t.Errorf("the SDK's line: %v", line)
	}
}
