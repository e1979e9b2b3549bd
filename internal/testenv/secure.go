package testenv

// The secured stack (scripts/stack.sh --secure): Redis Cluster over TLS with
// ACL users, a TLS + SASL/SCRAM-SHA-512 broker with ACLs enforced and a
// broker that demands client certificates. Tests reach it as its admin and
// run the worker as the least-privileged user capper.

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/sasl/scram"

	"github.com/capper-dev/capper/internal/config"
	"github.com/capper-dev/capper/internal/kafkaadmin"
)

// Secure is the secured stack.
type Secure struct {
	Dir      string   // its state: tls/ (certificates and keys) and secrets/ (passwords)
	Redis    []string // TLS only; users admin, capper, capper-noperm
	Kafka    []string // SASL_SSL, SCRAM-SHA-512, ACLs enforced; users admin, capper, capper-noperm
	MTLS     []string // the same broker's SSL listener: a client certificate signed by tls/ca.crt required, CN=X is User:X
	S3       string
	RedisACL string // the rules of the Redis user capper (what docs/security.md prints)
}

// SecureStack returns the secured stack (skipped without it, failed under CI=true).
func SecureStack(t testing.TB) *Secure {
	t.Helper()
	return &Secure{
		Dir:      require(t, "CAPPER_TEST_SECURE_DIR"),
		Redis:    strings.Split(require(t, "CAPPER_TEST_SECURE_REDIS_ADDRS"), ","),
		Kafka:    strings.Split(require(t, "CAPPER_TEST_SECURE_KAFKA_BROKERS"), ","),
		MTLS:     strings.Split(require(t, "CAPPER_TEST_SECURE_MTLS_BROKERS"), ","),
		S3:       require(t, "CAPPER_TEST_SECURE_S3_ENDPOINT"),
		RedisACL: require(t, "CAPPER_TEST_SECURE_REDIS_ACL"),
	}
}

// Path returns a file of the stack's state, e.g. "tls/ca.crt".
func (s *Secure) Path(rel string) string { return filepath.Join(s.Dir, rel) }

// Secret returns the password in secrets/name, e.g. "kafka-capper".
func (s *Secure) Secret(t testing.TB, name string) string {
	t.Helper()
	b, err := os.ReadFile(s.Path("secrets/" + name))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

func (s *Secure) roots(t testing.TB) *x509.CertPool {
	t.Helper()
	b, err := os.ReadFile(s.Path("tls/ca.crt"))
	if err != nil {
		t.Fatal(err)
	}
	p := x509.NewCertPool()
	if !p.AppendCertsFromPEM(b) {
		t.Fatal("no certificate in tls/ca.crt")
	}
	return p
}

// Kafka modes of the secured stack.
const (
	SCRAM = "scram" // TLS + SASL/SCRAM-SHA-512 as the user capper, with capper's ACLs
	MTLS  = "mtls"  // TLS with the client certificate CN=capper
)

// SecureOptions shape a secured slice.
type SecureOptions struct {
	// Omit drops grants from capper's Kafka ACLs, to test a missing one.
	Omit func(kafkaadmin.Grant, kafkaadmin.Names) bool
	// HoldTiers, when set, enables holding on these delay tiers (EnableHold)
	// before the grants, which then cover the delay topics and groups.
	HoldTiers []string
}

// NewSecureStack is NewStack on the secured stack: the admin creates the
// topics and grants User:capper exactly kafkaadmin.Grants on them; the worker's
// config reaches Redis and Kafka as capper over TLS (SCRAM, or the client
// certificate CN=capper in mode MTLS), with the passwords in files. Its key prefix starts with "fc:" (the Redis user's key pattern).
func NewSecureStack(t *testing.T, mode string, partitions int, o SecureOptions) *Stack {
	t.Helper()
	sec := SecureStack(t)
	roots := sec.roots(t)
	admin := &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}
	s := &Stack{T: t}
	s.redisOpts.Username, s.redisOpts.Password, s.redisOpts.TLSConfig = "admin", sec.Secret(t, "redis-admin"), admin
	b := backend{redis: sec.Redis, s3: sec.S3, keyPrefix: func(name string) string { return "fc:" + name }}
	b.redisConfig = fmt.Sprintf("  username: capper\n  password_file: %s\n  tls: {enabled: true, ca_file: %s}\n",
		sec.Path("secrets/redis-capper"), sec.Path("tls/ca.crt"))
	// The tests' own clients (topics, ACLs, producing, collecting) are the admin's, over SASL_SSL.
	mech, err := scram.Mechanism(scram.SHA512, "admin", sec.Secret(t, "kafka-admin"))
	if err != nil {
		t.Fatal(err)
	}
	s.dialer = &kafka.Dialer{Timeout: 10 * time.Second, TLS: admin, SASLMechanism: mech}
	s.transport = &kafka.Transport{TLS: admin, SASL: mech}
	b.brokers = sec.Kafka
	switch mode {
	case SCRAM:
		b.kafkaConfig = fmt.Sprintf("  sasl_mechanism: scram-sha-512\n  sasl_username: capper\n  sasl_password_file: %s\n  tls: {enabled: true, ca_file: %s}\n",
			sec.Path("secrets/kafka-capper"), sec.Path("tls/ca.crt"))
	case MTLS:
		// The broker maps the certificate's CN=capper to User:capper: the same ACLs apply.
		b.workerBrokers = sec.MTLS
		b.kafkaConfig = fmt.Sprintf("  tls: {enabled: true, ca_file: %s, cert_file: %s, key_file: %s}\n",
			sec.Path("tls/ca.crt"), sec.Path("tls/client.crt"), sec.Path("tls/client.key"))
	default:
		t.Fatalf("unknown mode %q", mode)
	}
	s.create(partitions, nil, b)
	if len(o.HoldTiers) > 0 {
		s.EnableHold(partitions, o.HoldTiers...)
	}
	s.grant(o.Omit)
	return s
}

// grant gives the user capper its ACLs on this slice's topics and group.
func (s *Stack) grant(omit func(kafkaadmin.Grant, kafkaadmin.Names) bool) {
	s.T.Helper()
	var entries []kafka.ACLEntry
	names := s.ACLNames()
	for _, g := range kafkaadmin.Grants(names) {
		if omit == nil || !omit(g, names) {
			entries = append(entries, g.Entry("User:capper"))
		}
	}
	s.CreateACLs(entries...)
}

// ACLNames returns the Kafka resources of this slice's worker.
func (s *Stack) ACLNames() kafkaadmin.Names {
	return kafkaadmin.NamesOf(s.group(), config.Topics{Input: s.Topics[0], Allowed: s.Topics[1], Capped: s.Topics[2], DLQ: s.Topics[3],
		Held: s.Held, DelayPrefix: s.Topics[0] + ".delay."}, s.Held != "")
}

func (s *Stack) group() string { return s.Topics[0] } // the config's group_id is the input topic's name

// CreateACLs creates ACL entries as the secured stack's admin.
func (s *Stack) CreateACLs(entries ...kafka.ACLEntry) {
	s.T.Helper()
	if len(entries) == 0 {
		return
	}
	client := s.adminClient()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := client.CreateACLs(ctx, &kafka.CreateACLsRequest{ACLs: entries})
	if err != nil {
		s.T.Fatalf("create ACLs: %v", err)
	}
	for _, e := range resp.Errors {
		if e != nil {
			s.T.Fatalf("create ACLs: %v", e)
		}
	}
}

// adminClient is a client of the slice's broker as the stack's admin (kafka-go's default on the plain stack).
func (s *Stack) adminClient() *kafka.Client {
	return &kafka.Client{Addr: kafka.TCP(s.Brokers...), Transport: s.roundTripper(), Timeout: 10 * time.Second}
}

// DeleteACLs deletes exactly these ACL entries as the secured stack's admin.
func (s *Stack) DeleteACLs(entries ...kafka.ACLEntry) {
	s.T.Helper()
	var filters []kafka.DeleteACLsFilter
	for _, e := range entries {
		filters = append(filters, kafka.DeleteACLsFilter{ResourceTypeFilter: e.ResourceType, ResourceNameFilter: e.ResourceName,
			ResourcePatternTypeFilter: e.ResourcePatternType, PrincipalFilter: e.Principal, HostFilter: e.Host,
			Operation: e.Operation, PermissionType: e.PermissionType})
	}
	client := s.adminClient()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := client.DeleteACLs(ctx, &kafka.DeleteACLsRequest{Filters: filters})
	if err != nil {
		s.T.Fatalf("delete ACLs: %v", err)
	}
	for _, r := range resp.Results {
		if r.Error != nil {
			s.T.Fatalf("delete ACLs: %v", r.Error)
		}
		if len(r.MatchingACLs) == 0 {
			s.T.Fatalf("delete ACLs: no ACL matched %+v", filters)
		}
	}
}

// IssueCert writes a certificate for 127.0.0.1 (server and client use),
// signed by the stack's CA ("ca") or the one that signed nothing else
// ("other-ca") and valid from notBefore to notAfter, with its key, and
// returns their paths: for expired, not-yet-valid and untrusted certificates.
func (s *Secure) IssueCert(t testing.TB, ca, cn string, notBefore, notAfter time.Time) (certFile, keyFile string) {
	t.Helper()
	caPair, err := tls.LoadX509KeyPair(s.Path("tls/"+ca+".crt"), s.Path("tls/"+ca+".key"))
	if err != nil {
		t.Fatal(err)
	}
	caCert, err := x509.ParseCertificate(caPair.Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62))
	tmpl := &x509.Certificate{
		SerialNumber: serial, Subject: pkix.Name{CommonName: cn}, NotBefore: notBefore, NotAfter: notAfter,
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, DNSNames: []string{"localhost"},
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caPair.PrivateKey)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	certFile, keyFile = filepath.Join(dir, ca+"-"+cn+".crt"), filepath.Join(dir, ca+"-"+cn+".key")
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), 0o600); err != nil {
		t.Fatal(err)
	}
	return certFile, keyFile
}

// Committed returns how many messages of the input topic the worker's group
// has committed (the sum of its committed offsets).
func (s *Stack) Committed(t testing.TB) int64 {
	t.Helper()
	client := s.adminClient()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	md, err := client.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{s.Topics[0]}})
	if err != nil || len(md.Topics) != 1 {
		t.Fatalf("metadata of %s: %v", s.Topics[0], err)
	}
	var parts []int
	for _, p := range md.Topics[0].Partitions {
		parts = append(parts, p.ID)
	}
	off, err := client.OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: s.group(), Topics: map[string][]int{s.Topics[0]: parts}})
	if err != nil {
		t.Fatalf("committed offsets of %s: %v", s.group(), err)
	}
	var n int64
	for _, p := range off.Topics[s.Topics[0]] {
		n += max(0, p.CommittedOffset)
	}
	return n
}

// WaitGroupMembers waits until the worker's group is stable with n members,
// each with partitions of the input topic assigned, or fails the test after
// timeout.
func (s *Stack) WaitGroupMembers(t testing.TB, n int, timeout time.Duration) {
	t.Helper()
	client := s.adminClient()
	var last string
	for end := time.Now().Add(timeout); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		res, err := client.DescribeGroups(ctx, &kafka.DescribeGroupsRequest{GroupIDs: []string{s.group()}})
		cancel()
		if err != nil || len(res.Groups) != 1 {
			last = fmt.Sprint(err)
			continue
		}
		g := res.Groups[0]
		assigned := 0
		for _, m := range g.Members {
			for _, tp := range m.MemberAssignments.Topics {
				if tp.Topic == s.Topics[0] && len(tp.Partitions) > 0 {
					assigned++
				}
			}
		}
		if g.GroupState == "Stable" && len(g.Members) == n && assigned == n {
			return
		}
		last = fmt.Sprintf("state %s, %d members, %d with partitions", g.GroupState, len(g.Members), assigned)
	}
	t.Fatalf("group %s: not %d members with partitions within %v (last: %s)", s.group(), n, timeout, last)
}

// ProcessPartitions returns the partitions of topic that the worker's group
// (suffix "" for the input's, ".delay.TIER" for a delay tier's) assigned to
// the members of the worker process pid (capper's member tokens name the
// process), and how many members the group has.
func (s *Stack) ProcessPartitions(t testing.TB, suffix, topic string, pid int) (parts []int, members int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	group := s.group() + suffix
	res, err := s.adminClient().DescribeGroups(ctx, &kafka.DescribeGroupsRequest{GroupIDs: []string{group}})
	if err != nil || len(res.Groups) != 1 || res.Groups[0].Error != nil {
		t.Fatalf("describe group %s: %v %+v", group, err, res)
	}
	token := fmt.Appendf(nil, "capper %d-", pid)
	for _, m := range res.Groups[0].Members {
		if !bytes.HasPrefix(m.MemberMetadata.UserData, token) {
			continue
		}
		for _, tp := range m.MemberAssignments.Topics {
			if tp.Topic == topic {
				parts = append(parts, tp.Partitions...)
			}
		}
	}
	slices.Sort(parts)
	return parts, len(res.Groups[0].Members)
}
