package main_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/capper-dev/capper/internal/testenv"
	"github.com/capper-dev/capper/segments"
)

func capper(t *testing.T, stdin string, env []string, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(capperBin, args...)
	cmd.Stdin = strings.NewReader(stdin)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func TestSegmentsCommands(t *testing.T) {
	dir := t.TempDir()
	// build: ids from standard input; a bad line names its number.
	out, err := capper(t, "3\n1\n2\n\n# comment\n70000\n", nil, "segments", "build", "--name", "new", "--out", filepath.Join(dir, "new.roaring"))
	if err != nil || !strings.Contains(out, "4 users") {
		t.Fatalf("build: %v\n%s", err, out)
	}
	if out, err := capper(t, "1\n2\nabc\n", nil, "segments", "build", "--name", "x", "--out", filepath.Join(dir, "x.bin")); err == nil || !strings.Contains(out, "line 3") {
		t.Fatalf("build with a bad line: %v\n%s", err, out)
	}
	// inspect: a Java-written bitmap.
	out, err = capper(t, "", nil, "segments", "inspect", "../../fixtures/roaring/java/bitmapwithruns.bin")
	if err != nil || !strings.Contains(out, "cardinality  200100") || !strings.Contains(out, "max id       799999") {
		t.Fatalf("inspect: %v\n%s", err, out)
	}
	// upload: every file is validated first; a corrupt one means nothing is uploaded.
	endpoint, bucket := testenv.S3(t)
	env := []string{"AWS_ACCESS_KEY_ID=test", "AWS_SECRET_ACCESS_KEY=test", "AWS_REGION=us-east-1",
		"CAPPER_SEGMENTS_S3_ENDPOINT=" + endpoint, "CAPPER_SEGMENTS_S3_PATH_STYLE=true"}
	prefix := testenv.Unique("segcmd")
	dest := "s3://" + bucket + "/" + prefix
	if err := os.WriteFile(filepath.Join(dir, "bad.roaring"), []byte("garbage"), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := capper(t, "", env, "segments", "upload", dir, dest); err == nil || !strings.Contains(out, "nothing uploaded") {
		t.Fatalf("upload with a corrupt file: %v\n%s", err, out)
	}
	src := &segments.S3Source{Client: testenv.S3Client(endpoint), Bucket: bucket, Prefix: prefix}
	if objs, err := src.List(context.Background()); err != nil || len(objs) != 0 {
		t.Fatalf("after a refused upload the prefix holds %v (%v)", objs, err)
	}
	os.Remove(filepath.Join(dir, "bad.roaring"))
	if out, err := capper(t, "", env, "segments", "upload", dir, dest); err != nil {
		t.Fatalf("upload: %v\n%s", err, out)
	}
	out, err = capper(t, "", env, "segments", "inspect", dest+"/new.roaring")
	if err != nil || !strings.Contains(out, "cardinality  4") || !strings.Contains(out, "min id       1") {
		t.Fatalf("inspect after upload: %v\n%s", err, out)
	}
}
