// Package fault names the backend failures that no retry fixes: a password,
// a certificate, a CA or a grant is wrong, and only a change of
// configuration (or of the server's ACLs) helps. The daemon fails at start-up
// on them at once instead of retrying; the worker logs them at error level
// with the cause while it retries (a grant may be restored).
package fault

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"strings"

	"github.com/segmentio/kafka-go"
)

// Cause returns why err cannot succeed on a retry ("authentication failed",
// "permission denied", "TLS: ..."), or "" when err may be transient.
func Cause(err error) string {
	if err == nil {
		return ""
	}
	var we kafka.WriteErrors // per message, without Unwrap
	if errors.As(err, &we) {
		for _, e := range we {
			if c := Cause(e); c != "" {
				return c
			}
		}
	}
	var unknown x509.UnknownAuthorityError
	var invalid x509.CertificateInvalidError
	var hostname x509.HostnameError
	var alert tls.AlertError
	var record tls.RecordHeaderError
	switch {
	case errors.As(err, &unknown):
		return "TLS: the server's certificate is signed by an unknown authority (not by the tls.ca_file given)"
	case errors.As(err, &invalid) && invalid.Reason == x509.Expired:
		return "TLS: the server's certificate has expired or is not valid yet"
	case errors.As(err, &invalid):
		return "TLS: the server's certificate is not valid"
	case errors.As(err, &hostname):
		return "TLS: the server's certificate is not valid for its address (see tls.server_name)"
	case errors.As(err, &alert):
		return "TLS: the server refused the handshake (" + alert.Error() + "): a client certificate missing, expired or not trusted by the server"
	case errors.As(err, &record):
		return "TLS: the server does not speak TLS (is tls.enabled right, and the port?)"
	case errors.Is(err, kafka.SASLAuthenticationFailed):
		return "authentication failed"
	case errors.Is(err, kafka.UnsupportedSASLMechanism), errors.Is(err, kafka.IllegalSASLState):
		return "authentication failed: the broker does not offer this SASL mechanism"
	case errors.Is(err, kafka.TopicAuthorizationFailed), errors.Is(err, kafka.GroupAuthorizationFailed),
		errors.Is(err, kafka.ClusterAuthorizationFailed), errors.Is(err, kafka.TransactionalIDAuthorizationFailed):
		return "permission denied"
	}
	msg := err.Error()
	switch {
	case strings.Contains(msg, "WRONGPASS"), strings.Contains(msg, "NOAUTH"), strings.Contains(msg, "invalid password"):
		return "authentication failed"
	case strings.Contains(msg, "NOPERM"), strings.Contains(msg, "Authorization Failed"),
		strings.Contains(msg, "The user executing the script can't run this command"): // a command a script calls
		return "permission denied"
	case strings.Contains(msg, "remote error: tls: bad certificate"), strings.Contains(msg, "remote error: tls: certificate required"),
		strings.Contains(msg, "remote error: tls: unknown certificate authority"), strings.Contains(msg, "remote error: tls: certificate expired"):
		// Apache Kafka answers bad_certificate to a missing, expired or untrusted client certificate alike
		return "TLS: the server refused capper's client certificate (missing, expired, or not signed by a CA it trusts)"
	case strings.Contains(msg, "tls: failed to verify certificate"), strings.Contains(msg, "remote error: tls:"):
		return "TLS: " + msg[strings.Index(msg, "tls:")+5:]
	}
	return ""
}

// Hint is what to check for a permanent cause of backend ("redis", "kafka").
func Hint(backend, cause string) string {
	switch {
	case backend == "redis" && strings.HasPrefix(cause, "authentication"):
		return "check redis.username and the password (CAPPER_REDIS_PASSWORD or redis.password_file)"
	case backend == "kafka" && strings.HasPrefix(cause, "authentication"):
		return "check kafka.sasl_mechanism, kafka.sasl_username and the password (CAPPER_KAFKA_SASL_PASSWORD or kafka.sasl_password_file)"
	case strings.HasPrefix(cause, "permission"):
		return "grant capper's " + backend + " ACLs (docs/security.md)"
	default:
		return "check " + backend + ".tls (ca_file, cert_file, key_file, server_name)"
	}
}
