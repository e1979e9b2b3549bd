package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"github.com/capper-dev/capper/segments"
	"github.com/capper-dev/capper/segments/segtool"
)

func runSegments(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	const (
		inspectUsage = "usage: capper segments inspect FILE|s3://bucket/key\n\ncardinality, sizes, container kinds, min and max id of a roaring bitmap\n\nexamples:\n  capper segments inspect new.roaring\n  capper segments inspect s3://capper-segments/segments/new.roaring"
		uploadUsage  = "usage: capper segments upload DIR s3://bucket/prefix\n\nvalidates every DIR/*.roaring, then uploads them (AWS credentials from the SDK's default chain;\nCAPPER_SEGMENTS_S3_ENDPOINT and CAPPER_SEGMENTS_S3_PATH_STYLE=true for S3-compatible stores)\n\nexamples:\n  capper segments upload ./segments s3://capper-segments/segments"
	)
	if len(args) == 0 || isHelp(args) {
		fmt.Fprint(stdout, usage)
		if len(args) == 0 {
			return errUsage
		}
		return nil
	}
	switch args[0] {
	case "build":
		fs := flag.NewFlagSet("capper segments build", flag.ContinueOnError)
		name := fs.String("name", "", "segment name (Required)")
		out := fs.String("out", "", "output file (Required); use NAME.roaring to upload it as segment NAME")
		from := fs.String("from", "-", "file of user ids, one per line; - for standard input")
		if err := parseFlags(fs, "capper segments build --name NAME --out FILE [--from FILE|-]", args[1:], stdout, stderr); err != nil {
			return err
		}
		if *name == "" || *out == "" {
			fmt.Fprintln(stderr, "capper segments build: --name and --out are required")
			return errUsage
		}
		in := io.Reader(os.Stdin)
		if *from != "-" {
			f, err := os.Open(*from)
			if err != nil {
				return err
			}
			defer f.Close()
			in = f
		}
		bm, err := segtool.Build(in)
		if err != nil {
			return fmt.Errorf("segment %q from %s: %w", *name, *from, err)
		}
		data, err := segtool.Encode(bm)
		if err != nil {
			return err
		}
		if err := os.WriteFile(*out, data, 0o644); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "segment %s: %d users, %d bytes -> %s\n", *name, bm.GetCardinality(), len(data), *out)
		return nil
	case "inspect":
		if isHelp(args[1:]) {
			fmt.Fprintln(stdout, inspectUsage)
			return nil
		}
		if len(args) != 2 {
			fmt.Fprintln(stderr, inspectUsage)
			return errUsage
		}
		data, err := readObject(ctx, args[1])
		if err != nil {
			return err
		}
		bm, err := segments.Decode(data)
		if err != nil {
			return fmt.Errorf("%s: %w", args[1], err)
		}
		in := segtool.Inspect(bm)
		fmt.Fprintf(stdout, "%s\n  cardinality  %d\n  serialized   %d bytes\n  in memory    %d bytes\n  containers   array %d, bitmap %d, run %d\n",
			args[1], in.Cardinality, in.SerializedBytes, in.HeapBytes, in.Containers["array"], in.Containers["bitmap"], in.Containers["run"])
		if in.Cardinality > 0 {
			fmt.Fprintf(stdout, "  min id       %d\n  max id       %d\n", in.Min, in.Max)
		}
		return nil
	case "upload":
		if isHelp(args[1:]) {
			fmt.Fprintln(stdout, uploadUsage)
			return nil
		}
		if len(args) != 3 {
			fmt.Fprintln(stderr, uploadUsage)
			return errUsage
		}
		return upload(ctx, args[1], args[2], stdout)
	default:
		fmt.Fprintf(stderr, "capper segments: unknown command %q\n", args[0])
		return errUsage
	}
}

func s3FromEnv() segments.S3Config {
	pathStyle, _ := strconv.ParseBool(os.Getenv("CAPPER_SEGMENTS_S3_PATH_STYLE")) // like the config's booleans: 1, t, true, TRUE...
	return segments.S3Config{
		Endpoint:  os.Getenv("CAPPER_SEGMENTS_S3_ENDPOINT"),
		Region:    os.Getenv("CAPPER_SEGMENTS_S3_REGION"),
		PathStyle: pathStyle,
	}
}

func readObject(ctx context.Context, loc string) ([]byte, error) {
	if !strings.HasPrefix(loc, "s3://") {
		return os.ReadFile(loc)
	}
	bucket, key, err := segments.ParseS3URI(loc)
	if err != nil {
		return nil, err
	}
	cl, err := segments.NewS3Client(ctx, s3FromEnv())
	if err != nil {
		return nil, err
	}
	return (&segments.S3Source{Client: cl, Bucket: bucket}).Read(ctx, key)
}

// upload validates every DIR/*.roaring and uploads them all; nothing is
// uploaded when one is invalid.
func upload(ctx context.Context, dir, dest string, stdout io.Writer) error {
	bucket, prefix, err := segments.ParseS3URI(dest)
	if err != nil {
		return err
	}
	cl, err := segments.NewS3Client(ctx, s3FromEnv())
	if err != nil {
		return err
	}
	up := &segtool.Uploader{Client: cl, Bucket: bucket, Prefix: prefix}
	done, err := up.UploadDir(ctx, dir)
	for _, u := range done {
		fmt.Fprintf(stdout, "uploaded %s (%d bytes) to %s\n", u.File, u.Bytes, u.URI)
	}
	return err
}
