package segments

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"path/filepath"
	"strings"

	"github.com/aws/aws-sdk-go-v2/aws"
	awsconfig "github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/smithy-go/logging"
)

// Ext is the file extension of a segment object.
const Ext = ".roaring"

// Object is one segment object of a source.
type Object struct {
	// Segment is the object's name without the prefix and Ext.
	Segment string
	// Key locates the object in its source.
	Key string
	// ETag changes whenever the content changes.
	ETag string
	// Size is the object's size in bytes.
	Size int64
}

// Source lists and reads segment objects. Implementations must be safe for
// concurrent use.
type Source interface {
	// List returns the segment objects (named *.roaring) the source holds.
	List(ctx context.Context) ([]Object, error)
	// Read returns the whole content of the object with key.
	Read(ctx context.Context, key string) ([]byte, error)
	// String names the source in logs and errors.
	String() string
}

// DirSource reads segment objects from a local directory, for development.
// The ETag of a file is derived from its size and modification time.
type DirSource struct{ Dir string }

func (d DirSource) String() string { return d.Dir }

// List implements Source.
func (d DirSource) List(ctx context.Context) ([]Object, error) {
	entries, err := os.ReadDir(d.Dir)
	if err != nil {
		return nil, fmt.Errorf("list %s: %w", d.Dir, err)
	}
	var out []Object
	for _, e := range entries {
		if e.IsDir() || !strings.HasSuffix(e.Name(), Ext) {
			continue
		}
		fi, err := e.Info()
		if err != nil {
			return nil, fmt.Errorf("list %s: %w", d.Dir, err)
		}
		out = append(out, Object{
			Segment: strings.TrimSuffix(e.Name(), Ext),
			Key:     filepath.Join(d.Dir, e.Name()),
			ETag:    fmt.Sprintf("%d-%d", fi.Size(), fi.ModTime().UnixNano()),
			Size:    fi.Size(),
		})
	}
	return out, nil
}

// Read implements Source.
func (d DirSource) Read(ctx context.Context, key string) ([]byte, error) {
	return os.ReadFile(key)
}

// S3API is the part of *s3.Client that S3Source uses.
type S3API interface {
	ListObjectsV2(ctx context.Context, in *s3.ListObjectsV2Input, opts ...func(*s3.Options)) (*s3.ListObjectsV2Output, error)
	GetObject(ctx context.Context, in *s3.GetObjectInput, opts ...func(*s3.Options)) (*s3.GetObjectOutput, error)
}

// S3Source reads segment objects from s3://Bucket/Prefix.
type S3Source struct {
	Client S3API
	Bucket string
	// Prefix is the key prefix without a trailing slash; empty for the bucket's root.
	Prefix string
}

func (s *S3Source) String() string { return "s3://" + s.Bucket + "/" + s.Prefix }

func (s *S3Source) keyPrefix() string {
	if s.Prefix == "" {
		return ""
	}
	return strings.TrimSuffix(s.Prefix, "/") + "/"
}

// List implements Source. Only objects directly under the prefix count.
func (s *S3Source) List(ctx context.Context) ([]Object, error) {
	prefix := s.keyPrefix()
	p := s3.NewListObjectsV2Paginator(s.Client, &s3.ListObjectsV2Input{Bucket: &s.Bucket, Prefix: &prefix})
	var out []Object
	for p.HasMorePages() {
		page, err := p.NextPage(ctx)
		if err != nil {
			return nil, fmt.Errorf("list %s: %w", s, err)
		}
		for _, o := range page.Contents {
			key := aws.ToString(o.Key)
			name := strings.TrimPrefix(key, prefix)
			if !strings.HasSuffix(name, Ext) || strings.Contains(name, "/") {
				continue
			}
			out = append(out, Object{Segment: strings.TrimSuffix(name, Ext), Key: key, ETag: aws.ToString(o.ETag), Size: aws.ToInt64(o.Size)})
		}
	}
	return out, nil
}

// Read implements Source.
func (s *S3Source) Read(ctx context.Context, key string) ([]byte, error) {
	out, err := s.Client.GetObject(ctx, &s3.GetObjectInput{Bucket: &s.Bucket, Key: &key})
	if err != nil {
		return nil, fmt.Errorf("get s3://%s/%s: %w", s.Bucket, key, err)
	}
	defer out.Body.Close()
	data, err := io.ReadAll(io.LimitReader(out.Body, MaxObjectBytes+1))
	if err != nil {
		return nil, fmt.Errorf("read s3://%s/%s: %w", s.Bucket, key, err)
	}
	if len(data) > MaxObjectBytes {
		return nil, fmt.Errorf("s3://%s/%s is larger than %d bytes", s.Bucket, key, MaxObjectBytes)
	}
	return data, nil
}

// S3Config says how to reach S3 or an S3-compatible store. Credentials come
// from the AWS default chain (environment, shared files, IAM roles).
type S3Config struct {
	// Endpoint overrides the S3 endpoint, e.g. http://127.0.0.1:9000. Defaults to AWS.
	Endpoint string `yaml:"endpoint"`
	// Region is the bucket's region. Defaults to AWS_REGION, then us-east-1.
	Region string `yaml:"region"`
	// PathStyle addresses buckets as ENDPOINT/BUCKET (most S3-compatible stores need it). Defaults to false.
	PathStyle bool `yaml:"path_style"`
}

// NewS3Client returns an S3 client for cfg.
func NewS3Client(ctx context.Context, cfg S3Config) (*s3.Client, error) {
	// The SDK's own lines (a retry, a checksum skipped) go through slog, so
	// that a worker's log stays one stream of JSON lines.
	opts := []func(*awsconfig.LoadOptions) error{awsconfig.WithLogger(logging.LoggerFunc(func(c logging.Classification, format string, v ...any) {
		level := slog.LevelInfo
		if c == logging.Warn {
			level = slog.LevelWarn
		}
		slog.Default().Log(context.Background(), level, fmt.Sprintf(format, v...), "component", "aws")
	}))}
	if cfg.Region != "" {
		opts = append(opts, awsconfig.WithRegion(cfg.Region))
	}
	ac, err := awsconfig.LoadDefaultConfig(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("load aws config: %w", err)
	}
	if ac.Region == "" {
		ac.Region = "us-east-1"
	}
	return s3.NewFromConfig(ac, func(o *s3.Options) {
		if cfg.Endpoint != "" {
			o.BaseEndpoint = aws.String(cfg.Endpoint)
		}
		o.UsePathStyle = cfg.PathStyle
		o.DisableLogOutputChecksumValidationSkipped = true
	}), nil
}

// ParseS3URI splits s3://bucket/prefix.
func ParseS3URI(uri string) (bucket, prefix string, err error) {
	u, err := url.Parse(uri)
	if err != nil || u.Scheme != "s3" || u.Host == "" {
		return "", "", fmt.Errorf("%q is not an s3://bucket/prefix URI", uri)
	}
	return u.Host, strings.Trim(u.Path, "/"), nil
}

// OpenSource returns the Source for location: s3://bucket/prefix, or a local
// directory (a path, or file:///path).
func OpenSource(ctx context.Context, location string, s3cfg S3Config) (Source, error) {
	switch {
	case strings.HasPrefix(location, "s3://"):
		bucket, prefix, err := ParseS3URI(location)
		if err != nil {
			return nil, err
		}
		cl, err := NewS3Client(ctx, s3cfg)
		if err != nil {
			return nil, err
		}
		return &S3Source{Client: cl, Bucket: bucket, Prefix: prefix}, nil
	case location == "":
		return nil, errors.New("empty segment source")
	default:
		dir := strings.TrimPrefix(location, "file://")
		fi, err := os.Stat(dir)
		if err != nil {
			return nil, fmt.Errorf("segment source %q: %w", location, err)
		}
		if !fi.IsDir() {
			return nil, fmt.Errorf("segment source %q is not a directory", location)
		}
		return DirSource{Dir: dir}, nil
	}
}
