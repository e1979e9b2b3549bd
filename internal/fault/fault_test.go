package fault

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"testing"

	"github.com/segmentio/kafka-go"
)

func TestCause(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want string
	}{
		{"nil", nil, ""},
		{"eof is transient", io.ErrUnexpectedEOF, ""},
		{"timeout is transient", fmt.Errorf("dial: %w", errors.New("i/o timeout")), ""},
		{"unknown CA", &tls.CertificateVerificationError{Err: x509.UnknownAuthorityError{}}, "TLS: the server's certificate is signed by an unknown authority (not by the tls.ca_file given)"},
		{"expired", fmt.Errorf("x: %w", x509.CertificateInvalidError{Reason: x509.Expired}), "TLS: the server's certificate has expired or is not valid yet"},
		{"wrong host", x509.HostnameError{Certificate: &x509.Certificate{}, Host: "a"}, "TLS: the server's certificate is not valid for its address (see tls.server_name)"},
		{"plain server", tls.RecordHeaderError{Msg: "first record does not look like a TLS handshake"}, "TLS: the server does not speak TLS (is tls.enabled right, and the port?)"},
		{"kafka sasl", fmt.Errorf("auth: %w", kafka.SASLAuthenticationFailed), "authentication failed"},
		{"kafka group acl", kafka.GroupAuthorizationFailed, "permission denied"},
		{"kafka write acl", kafka.WriteErrors{nil, kafka.TopicAuthorizationFailed}, "permission denied"},
		{"kafka write transient", kafka.WriteErrors{nil, kafka.NotEnoughReplicas}, ""},
		{"redis wrongpass", errors.New("WRONGPASS invalid username-password pair or user is disabled."), "authentication failed"},
		{"redis noauth", errors.New("NOAUTH Authentication required."), "authentication failed"},
		{"redis noperm", fmt.Errorf("decide: %w", errors.New("NOPERM this user has no permissions to run the 'evalsha' command")), "permission denied"},
		{"redis noperm in a script", errors.New(`capping: decide job "j" for user 12: ERR The user executing the script can't run this command or subcommand script: capper_decide_62c1ce68554f71b2, on @user_function:824.`), "permission denied"},
		{"redis loading is transient", errors.New("LOADING Redis is loading the dataset in memory"), ""},
		{"client certificate refused (Kafka)", errors.New("kafka.(*Client).Metadata: remote error: tls: bad certificate"), "TLS: the server refused capper's client certificate (missing, expired, or not signed by a CA it trusts)"},
		{"client certificate required (Go servers)", errors.New("remote error: tls: certificate required"), "TLS: the server refused capper's client certificate (missing, expired, or not signed by a CA it trusts)"},
		{"other alert as text", errors.New("remote error: tls: protocol version not supported"), "TLS: protocol version not supported"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Cause(tc.err); got != tc.want {
				t.Errorf("Cause(%v) = %q, want %q", tc.err, got, tc.want)
			}
		})
	}
}
