package main_test

// The worker against the secured stack (scripts/stack.sh --secure): Redis
// over TLS as an ACL user with exactly docs/security.md's grants, Kafka over TLS with
// SCRAM-SHA-512 and ACLs, or with a client certificate (mTLS). Every failure
// a misconfigured deployment meets must end in one clear error, and no
// secret may appear in anything the worker prints or serves.

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/internal/kafkaadmin"
	"github.com/capper-dev/capper/internal/testenv"
)

// secrets returns what the worker may never print: the passwords of every
// user of the secured stack, the keys' bodies, and extra (e.g. a wrong
// password a test gives it).
func secrets(t *testing.T, sec *testenv.Secure, extra ...string) []string {
	t.Helper()
	out := append([]string{}, extra...)
	for _, u := range []string{"redis-admin", "redis-repl", "redis-capper", "redis-noperm", "kafka-admin", "kafka-capper", "kafka-noperm"} {
		out = append(out, sec.Secret(t, u))
	}
	for _, k := range []string{"tls/client.key", "tls/server.key", "tls/ca.key"} {
		b, err := os.ReadFile(sec.Path(k))
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(b), "\n") {
			if len(line) > 20 && !strings.HasPrefix(line, "-----") {
				out = append(out, line)
			}
		}
	}
	return out
}

func noSecret(t *testing.T, what, text string, secrets []string) {
	t.Helper()
	for _, s := range secrets {
		if strings.Contains(text, s) {
			t.Errorf("%s contains a secret (%.4s...):\n%s", what, s, text)
		}
	}
}

// TestSecuredEndToEnd runs the worker as the least-privileged user on both
// secured Kafka modes: exact decisions, a kill -9 mid-stream, and a rules
// reload, all through TLS, SASL and ACLs.
func TestSecuredEndToEnd(t *testing.T) {
	for _, mode := range []string{testenv.SCRAM, testenv.MTLS} {
		t.Run(mode, func(t *testing.T) {
			sec := testenv.SecureStack(t)
			secret := secrets(t, sec)
			s := testenv.NewSecureStack(t, mode, 3, testenv.SecureOptions{})
			s.EditConfig("log_level: warn", "log_level: info")
			jobs, bad := decisionJobs()
			s.Produce(jobs, bad...)
			w := startWith(s, true, secret)
			w.waitReady(t)
			checkDecisions(t, s, s.Collect(len(jobs)+len(bad), 60*time.Second), len(jobs), len(bad))
			metrics := scrape(t, w.metrics)
			noSecret(t, "/metrics", metrics, secret)

			// kill -9 mid-stream: nothing lost, nothing counted twice.
			blast := testenv.Blast("sec", 3000, 1000)
			for i := 0; i < 10; i++ {
				s.Produce(blast[i*300 : (i+1)*300])
				if i == 4 {
					w.kill(t)
					w = startWith(s, true, secret)
				}
			}
			all := append(append([]testenv.JobSpec{}, jobs...), blast...)
			s.CheckAccounting(all, s.CollectJobs(all, 90*time.Second), true)

			// A rules reload: the default cap goes from 2 to 3.
			b, err := os.ReadFile(s.Config)
			if err != nil {
				t.Fatal(err)
			}
			raised := strings.Replace(string(b), "default_caps: [{name: daily, window: 24h, limit: 2}]", "default_caps: [{name: daily, window: 24h, limit: 3}]", 1)
			if err := os.WriteFile(s.Config, []byte(raised), 0o644); err != nil {
				t.Fatal(err)
			}
			sent := time.Now()
			_ = w.cmd.Process.Signal(syscall.SIGHUP)
			w.waitLog(t, "rules reloaded", sent)
			more := []testenv.JobSpec{{ID: "r1", User: 5000, Channel: "email"}, {ID: "r2", User: 5000, Channel: "email"},
				{ID: "r3", User: 5000, Channel: "email"}, {ID: "r4", User: 5000, Channel: "email"}}
			s.Produce(more)
			got := map[string]string{}
			for _, o := range s.CollectJobs(more, 60*time.Second) {
				got[o.JobID] = o.Decision
			}
			if got["r3"] != "allowed" || got["r4"] != "capped" {
				t.Errorf("after raising the default cap to 3: %v, want r1-r3 allowed and r4 capped", got)
			}
		})
	}
}

func scrape(t *testing.T, addr string) string {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// startExpiredRedis starts a standalone Redis whose TLS certificate, signed by
// the stack's CA, expired yesterday, and returns its address.
func startExpiredRedis(t *testing.T, sec *testenv.Secure) string {
	t.Helper()
	cert, key := sec.IssueCert(t, "ca", "expired", time.Now().Add(-48*time.Hour), time.Now().Add(-24*time.Hour))
	addr := freeAddr(t)
	_, port, _ := net.SplitHostPort(addr)
	cmd := exec.Command("redis-server", "--port", "0", "--tls-port", port, "--bind", "127.0.0.1",
		"--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-cert-file", sec.Path("tls/ca.crt"),
		"--tls-auth-clients", "no", "--save", "", "--appendonly", "no", "--dir", t.TempDir())
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	for i := 0; i < 100; i++ {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			return addr
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("redis-server with an expired certificate did not listen on %s", addr)
	return ""
}

// TestSecuredStartupFailures starts the worker with one thing wrong each
// time. Each must stop within seconds (no hang, no retry loop on what a retry
// cannot fix) with one error line that names the backend and the cause,
// and print no secret.
func TestSecuredStartupFailures(t *testing.T) {
	sec := testenv.SecureStack(t)
	s := testenv.NewSecureStack(t, testenv.SCRAM, 1, testenv.SecureOptions{})
	const wrong = "wrong-password-sentinel"
	secret := secrets(t, sec, wrong)
	expired := startExpiredRedis(t, sec)
	expiredCert, expiredKey := sec.IssueCert(t, "ca", "capper", time.Now().Add(-48*time.Hour), time.Now().Add(-time.Hour))
	strangerCert, strangerKey := sec.IssueCert(t, "other-ca", "capper", time.Now().Add(-time.Hour), time.Now().Add(24*time.Hour))
	mtls := "CAPPER_KAFKA_BROKERS=" + strings.Join(sec.MTLS, ",")
	plain := testenv.KafkaBrokers(t) // the plain stack's PLAINTEXT listener
	for _, tc := range []struct {
		name string
		env  []string
		want []string // in the error, in order
	}{
		{"redis wrong password", []string{"CAPPER_REDIS_PASSWORD=" + wrong},
			[]string{"redis [", "authentication failed", "redis.username", "WRONGPASS"}},
		{"redis unknown CA", []string{"CAPPER_REDIS_TLS_CA_FILE=" + sec.Path("tls/other-ca.crt")},
			[]string{"redis [", "signed by an unknown authority", "redis.tls"}},
		{"redis expired certificate", []string{"CAPPER_REDIS_ADDRS=" + expired},
			[]string{"redis [" + expired + "]", "expired", "redis.tls"}},
		{"redis missing ACL permission", []string{"CAPPER_REDIS_USERNAME=capper-noperm", "CAPPER_REDIS_PASSWORD_FILE=" + sec.Path("secrets/redis-noperm")},
			[]string{"redis [", "permission denied", "docs/security.md", "NOPERM", "fcall"}},
		{"kafka wrong password", []string{"CAPPER_KAFKA_SASL_PASSWORD=" + wrong},
			[]string{"kafka [", "authentication failed", "kafka.sasl_username", "SASL Authentication Failed"}},
		{"kafka unknown CA", []string{"CAPPER_KAFKA_TLS_CA_FILE=" + sec.Path("tls/other-ca.crt")},
			[]string{"kafka [", "signed by an unknown authority", "kafka.tls"}},
		{"kafka missing group ACL", []string{"CAPPER_KAFKA_GROUP_ID=not-granted"},
			[]string{"kafka [", "permission denied", "docs/security.md", "consumer group not-granted", "Group Authorization Failed"}},
		{"kafka mTLS without a client certificate", []string{mtls, "CAPPER_KAFKA_SASL_MECHANISM="},
			[]string{"kafka [" + sec.MTLS[0] + "]", "TLS: the server refused capper's client certificate", "kafka.tls", "bad certificate"}},
		{"kafka mTLS with a certificate of another CA", []string{mtls, "CAPPER_KAFKA_SASL_MECHANISM=",
			"CAPPER_KAFKA_TLS_CERT_FILE=" + strangerCert, "CAPPER_KAFKA_TLS_KEY_FILE=" + strangerKey},
			[]string{"kafka [" + sec.MTLS[0] + "]", "TLS: the server refused capper's client certificate", "kafka.tls", "bad certificate"}},
		{"kafka plaintext against the SASL_SSL listener", []string{"CAPPER_KAFKA_TLS_ENABLED=false"},
			[]string{"kafka [" + sec.Kafka[0] + "]", "the broker expects TLS on this port", "kafka.tls.enabled"}},
		{"kafka TLS against a plaintext listener", []string{"CAPPER_KAFKA_BROKERS=" + plain[0]},
			[]string{"kafka [" + plain[0] + "]", "the broker does not speak TLS on this port", "kafka.tls.enabled"}},
		{"kafka mTLS with an expired client certificate", []string{mtls, "CAPPER_KAFKA_SASL_MECHANISM=",
			"CAPPER_KAFKA_TLS_CERT_FILE=" + expiredCert, "CAPPER_KAFKA_TLS_KEY_FILE=" + expiredKey},
			[]string{"kafka.tls.cert_file", "CN=capper", "expired at"}},
	} {
		t.Run(tc.name, func(t *testing.T) { expectStartupError(t, s.Config, tc.env, tc.want, secret) })
	}
	// --help with every secret in the environment prints none of them.
	cmd := exec.Command(capperBin, "run", "--help")
	cmd.Env = append(os.Environ(), "CAPPER_REDIS_PASSWORD="+sec.Secret(t, "redis-capper"), "CAPPER_KAFKA_SASL_PASSWORD="+sec.Secret(t, "kafka-capper"), "CAPPER_CONFIG="+s.Config)
	help, _ := cmd.CombinedOutput()
	noSecret(t, "capper run --help", string(help), secret)
}

// expectStartupError runs the worker with config and env and expects it to
// stop on its own within seconds, with exactly one error line that says
// each of want, in order, and prints no secret.
func expectStartupError(t *testing.T, config string, env, want, secret []string) {
	t.Helper()
	cmd := exec.Command(capperBin, "run", "--config", config)
	cmd.Env = append(append(os.Environ(), "AWS_ACCESS_KEY_ID=test", "AWS_SECRET_ACCESS_KEY=test", "AWS_REGION=us-east-1",
		"CAPPER_METRICS_ADDR="+freeAddr(t)), env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	began := time.Now()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	var err error
	select {
	case err = <-done:
	case <-time.After(45 * time.Second):
		_ = cmd.Process.Kill()
		<-done
		t.Fatalf("still running after 45 s (a hang):\n%s", out.String())
	}
	took := time.Since(began)
	if err == nil {
		t.Fatalf("exited 0:\n%s", out.String())
	}
	if took > 20*time.Second { // a backend that does not answer is retried for 30 s: this is not one
		t.Errorf("stopped after %v: the cause was retried instead of recognised", took)
	}
	var errs []string
	for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		var v map[string]any
		if json.Unmarshal([]byte(line), &v) == nil && v["level"] == "ERROR" {
			errs = append(errs, fmt.Sprint(v["err"]))
		}
	}
	if len(errs) != 1 {
		t.Fatalf("%d error lines, want 1:\n%s", len(errs), out.String())
	}
	rest := errs[0]
	for _, w := range want {
		i := strings.Index(rest, w)
		if i < 0 {
			t.Errorf("the error does not say %q (in order): %s", w, errs[0])
			break
		}
		rest = rest[i+len(w):]
	}
	noSecret(t, "the output", out.String(), secret)
	t.Logf("%.1f s: %s", took.Seconds(), errs[0])
}

// TestSecuredStartupMissingRead starts a holding worker with one Read grant
// missing each time: on the input topic or group, on the delay topics or
// groups. Metadata shows none of them (Describe is kept, and Read implies
// it); the start-up probes must, naming the topic or group, before the worker
// joins anything.
func TestSecuredStartupMissingRead(t *testing.T) {
	sec := testenv.SecureStack(t)
	for _, tc := range []struct {
		name     string
		resource kafka.ResourceType
		pick     func(kafkaadmin.Names) string
		want     func(kafkaadmin.Names) []string
	}{
		{"input topic", kafka.ResourceTypeTopic, func(n kafkaadmin.Names) string { return n.Input },
			func(n kafkaadmin.Names) []string {
				return []string{"permission denied", "topic " + n.Input + ": Read refused", "Topic Authorization Failed"}
			}},
		{"input group", kafka.ResourceTypeGroup, func(n kafkaadmin.Names) string { return n.Group },
			func(n kafkaadmin.Names) []string {
				return []string{"permission denied", "consumer group " + n.Group + ": Read refused", "Group Authorization Failed"}
			}},
		{"delay topics", kafka.ResourceTypeTopic, func(n kafkaadmin.Names) string { return n.DelayPrefix },
			func(n kafkaadmin.Names) []string {
				return []string{"permission denied", "topic " + n.DelayPrefix + "1s: Read refused", "Topic Authorization Failed"}
			}},
		{"delay groups", kafka.ResourceTypeGroup, func(n kafkaadmin.Names) string { return n.Group + ".delay." },
			func(n kafkaadmin.Names) []string {
				return []string{"permission denied", "consumer group " + n.Group + ".delay.1s: Read refused", "Group Authorization Failed"}
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			omitted := false
			s := testenv.NewSecureStack(t, testenv.SCRAM, 1, testenv.SecureOptions{HoldTiers: []string{"1s"},
				Omit: func(g kafkaadmin.Grant, n kafkaadmin.Names) bool {
					if g.Resource == tc.resource && g.Name == tc.pick(n) && g.Operation == kafka.ACLOperationTypeRead {
						omitted = true
						return true
					}
					return false
				}})
			if !omitted {
				t.Fatal("no such Read grant to leave out")
			}
			expectStartupError(t, s.Config, nil, tc.want(s.ACLNames()), secrets(t, sec))
		})
	}
}

// TestSecuredStartupUndescribableTopic leaves out every grant on the
// dead-letter topic (its Write implies Describe): the topic exists, but
// metadata leaves it out for this principal. The worker must stop saying it
// may not describe the topic, not that the topic does not exist.
func TestSecuredStartupUndescribableTopic(t *testing.T) {
	sec := testenv.SecureStack(t)
	omitted := 0
	s := testenv.NewSecureStack(t, testenv.SCRAM, 1, testenv.SecureOptions{Omit: func(g kafkaadmin.Grant, n kafkaadmin.Names) bool {
		if g.Resource == kafka.ResourceTypeTopic && g.Name == n.DLQ {
			omitted++
			return true
		}
		return false
	}})
	if omitted == 0 {
		t.Fatal("no grant on the dead-letter topic to leave out")
	}
	dlq := s.ACLNames().DLQ
	expectStartupError(t, s.Config, nil, []string{"permission denied", "topic " + dlq + ": this principal may not describe it",
		"Topic Authorization Failed"}, secrets(t, sec))
}

// TestSecuredMissingWriteGrant takes Write on the capped topic away from the
// worker: it decides, cannot write the capped outputs, and must retry, not
// ready, with an error naming the cause, and commit nothing. Once the grant
// is given, every job reaches its topic exactly as decided.
func TestSecuredMissingWriteGrant(t *testing.T) {
	sec := testenv.SecureStack(t)
	var missing kafkaadmin.Grant
	s := testenv.NewSecureStack(t, testenv.SCRAM, 1, testenv.SecureOptions{Omit: func(g kafkaadmin.Grant, n kafkaadmin.Names) bool {
		if g.Name == n.Capped && g.Operation == kafka.ACLOperationTypeWrite {
			missing = g
			return true
		}
		return false
	}})
	if missing.Name == "" {
		t.Fatal("no Write grant on the capped topic to take away")
	}
	jobs, bad := decisionJobs()
	s.Produce(jobs, bad...)
	w := startWith(s, true, secrets(t, sec))
	since := time.Now().Add(-time.Minute)
	w.waitLog(t, "writing outputs failed; retrying", since)
	_, line, _ := w.logTime("writing outputs failed; retrying", since)
	if line["level"] != "ERROR" || line["cause"] != "permission denied" || !strings.Contains(fmt.Sprint(line["err"]), "Topic Authorization Failed") {
		t.Errorf("the failed write is logged as %v; want level ERROR, cause permission denied, and the broker's error", line)
	}
	if code := readyz(t, w.metrics); code != http.StatusServiceUnavailable {
		t.Errorf("/readyz answers %d while outputs cannot be written, want 503", code)
	}
	if n := s.Committed(t); n != 0 {
		t.Errorf("%d offsets committed while the capped outputs were refused, want none", n)
	}
	if outs := s.CollectFrom([]string{s.Topics[2]}, 1, 3*time.Second); len(outs) != 0 {
		t.Errorf("%d outputs on the capped topic without a grant", len(outs))
	}
	s.CreateACLs(missing.Entry("User:capper"))
	checkDecisions(t, s, s.Collect(len(jobs)+len(bad), 60*time.Second), len(jobs), len(bad))
	for i := 0; readyz(t, w.metrics) != http.StatusOK; i++ {
		if i == 100 {
			t.Fatal("/readyz not ready 10 s after the grant")
		}
		time.Sleep(100 * time.Millisecond)
	}
	if n := s.Committed(t); n != int64(len(jobs)+len(bad)) {
		t.Errorf("%d offsets committed after the grant, want %d", n, len(jobs)+len(bad))
	}
}

func readyz(t *testing.T, addr string) int {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/readyz")
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

// waitReadyz polls /readyz until it answers want, for up to 45 s.
func waitReadyz(t *testing.T, w *worker, want int) {
	t.Helper()
	for end := time.Now().Add(45 * time.Second); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		if readyz(t, w.metrics) == want {
			return
		}
	}
	t.Fatalf("/readyz did not answer %d within 45 s:\n%s", want, w.logText())
}

// TestSecuredReadGrantTakenAway takes Read on the input topic, or on the
// input group, away from a running worker that stays in its group: Apache
// Kafka refuses its fetches (TOPIC_AUTHORIZATION_FAILED) or its heartbeats,
// joins and commits (GROUP_AUTHORIZATION_FAILED), which kafka-go retries
// inside the reader. The worker must say so at error level, naming the
// reader, and answer 503; nothing may be committed without its output. Once
// the grant is back it is ready again and every job has reached exactly one
// output topic.
func TestSecuredReadGrantTakenAway(t *testing.T) {
	sec := testenv.SecureStack(t)
	for _, tc := range []struct {
		name     string
		resource kafka.ResourceType
		refused  string // the broker's error
	}{
		{"input topic", kafka.ResourceTypeTopic, "Topic Authorization Failed"},
		{"input group", kafka.ResourceTypeGroup, "Group Authorization Failed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := testenv.NewSecureStack(t, testenv.SCRAM, 3, testenv.SecureOptions{})
			names := s.ACLNames()
			var read kafkaadmin.Grant
			for _, g := range kafkaadmin.Grants(names) {
				if g.Resource == tc.resource && (g.Name == names.Input || g.Name == names.Group) && g.Operation == kafka.ACLOperationTypeRead {
					read = g
				}
			}
			if read.Name == "" {
				t.Fatalf("no Read grant on the %s", tc.name)
			}
			first := testenv.Blast("ra", 300, 100)
			s.Produce(first)
			w := startWith(s, true, secrets(t, sec))
			s.CollectJobs(first, 60*time.Second)
			waitReadyz(t, w, http.StatusOK)

			since := time.Now()
			s.DeleteACLs(read.Entry("User:capper"))
			second := testenv.Blast("rb", 300, 100)
			s.Produce(second)
			waitReadyz(t, w, http.StatusServiceUnavailable)
			const msg = "the Kafka reader is refused; not ready until it reads again"
			w.waitLog(t, msg, since)
			_, line, _ := w.logTime(msg, since)
			if line["level"] != "ERROR" || line["cause"] != "permission denied" || !strings.Contains(fmt.Sprint(line["err"]), tc.refused) ||
				!strings.Contains(fmt.Sprint(line["reader"]), "topic "+names.Input+", group "+names.Group) {
				t.Errorf("the refused reader is logged as %v; want level ERROR, cause permission denied, the reader and %q", line, tc.refused)
			}
			// capper_ready follows /readyz. Messages the reader fetched before the
			// grant went away still come out of its queue (each a fetch that
			// worked), so readiness can flap while they drain: wait for 0
			// rather than catch one moment (on a busy machine the drain is slow).
			for end := time.Now().Add(30 * time.Second); scrapeMetric(t, w.metrics, "capper_ready") != 0; time.Sleep(50 * time.Millisecond) {
				if time.Now().After(end) {
					t.Fatal("capper_ready stayed 1 for 30 s while the reader is refused, want 0")
				}
			}
			refusedAt := time.Now()

			s.CreateACLs(read.Entry("User:capper"))
			all := append(append([]testenv.JobSpec{}, first...), second...)
			s.CheckAccounting(all, s.CollectJobs(all, 90*time.Second), true)
			waitReadyz(t, w, http.StatusOK)
			for end := time.Now().Add(30 * time.Second); s.Committed(t) != int64(len(all)); time.Sleep(100 * time.Millisecond) {
				if time.Now().After(end) {
					t.Fatalf("%d of %d offsets committed 30 s after the grant came back", s.Committed(t), len(all))
				}
			}
			n := 0
			for _, l := range strings.Split(w.logText(), "\n") {
				if strings.Contains(l, msg) {
					n++
				}
			}
			t.Logf("refused: %s; error lines: %d; ready again %.1f s after the grant", fmt.Sprint(line["err"]), n, time.Since(refusedAt).Seconds())
		})
	}
}

// TestSecuredDelayReadTakenAway takes Read on the delay topics, then on the
// delay groups, away from a running, holding worker: its tier reader is
// refused (held jobs would wait on the tier forever, silently). The worker
// must say so, naming the tier's topic and group, and answer 503; once the
// grant is back the held jobs are released and decided, each once.
func TestSecuredDelayReadTakenAway(t *testing.T) {
	sec := testenv.SecureStack(t)
	for _, tc := range []struct {
		name     string
		resource kafka.ResourceType
		pick     func(kafkaadmin.Names) string
		refused  string // the broker's error
	}{
		{"delay topics", kafka.ResourceTypeTopic, func(n kafkaadmin.Names) string { return n.DelayPrefix }, "Topic Authorization Failed"},
		{"delay groups", kafka.ResourceTypeGroup, func(n kafkaadmin.Names) string { return n.Group + ".delay." }, "Group Authorization Failed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := testenv.NewSecureStack(t, testenv.SCRAM, 1, testenv.SecureOptions{HoldTiers: []string{"1s"}})
			s.EditConfig(testenv.TestRules, `
rules:
  on_capped: {policy: hold, max_hold: 120s}
  segments: [{name: new, caps: [{name: burst, window: 3s, limit: 1}]}]
  default_caps: [{name: burst, window: 3s, limit: 1}]
`)
			names := s.ACLNames()
			var read kafkaadmin.Grant
			for _, g := range kafkaadmin.Grants(names) {
				if g.Resource == tc.resource && g.Name == tc.pick(names) && g.Operation == kafka.ACLOperationTypeRead {
					read = g
				}
			}
			if read.Name == "" {
				t.Fatalf("no Read grant on the %s", tc.name)
			}
			w := startWith(s, true, secrets(t, sec))
			waitReadyz(t, w, http.StatusOK)
			since := time.Now()
			s.DeleteACLs(read.Entry("User:capper"))
			jobs := []testenv.JobSpec{{ID: "d1", User: 300, Channel: "email"}, {ID: "d2", User: 300, Channel: "email"}, {ID: "d3", User: 300, Channel: "email"}}
			s.Produce(jobs) // d1 allowed; d2 and d3 held on the 1s tier, which cannot be read
			waitReadyz(t, w, http.StatusServiceUnavailable)
			const msg = "the Kafka reader is refused; not ready until it reads again"
			w.waitLog(t, msg, since)
			_, line, _ := w.logTime(msg, since)
			if line["level"] != "ERROR" || line["cause"] != "permission denied" || line["tier"] != "1s" ||
				!strings.Contains(fmt.Sprint(line["err"]), tc.refused) ||
				!strings.Contains(fmt.Sprint(line["reader"]), "topic "+names.DelayPrefix+"1s, group "+names.Group+".delay.1s") {
				t.Errorf("the refused tier reader is logged as %v; want level ERROR, cause permission denied, tier 1s, its topic and group and %q", line, tc.refused)
			}
			s.CreateACLs(read.Entry("User:capper"))
			outs := s.CollectJobs(jobs, 90*time.Second)
			got := map[string][]string{}
			for _, o := range outs {
				got[o.JobID] = append(got[o.JobID], o.Decision)
			}
			// Without Read on its group a tier reader that had joined still
			// fetches (that needs Read on the topic) and its jobs are decided,
			// but their commits are refused: once the grant is back they are
			// read again and answered duplicate (at least once, never counted
			// twice, one final topic).
			for _, j := range jobs {
				ds := got[j.ID]
				allowed, dups := 0, 0
				for _, d := range ds {
					switch d {
					case "allowed":
						allowed++
					case "duplicate":
						dups++
					}
				}
				if allowed != 1 || allowed+dups != len(ds) {
					t.Errorf("%s: outputs %v, want allowed once (d2 and d3 after their hold), and redeliveries answered duplicate", j.ID, ds)
				}
			}
			waitReadyz(t, w, http.StatusOK)
			t.Logf("refused: %s; outputs %v", fmt.Sprint(line["err"]), got)
		})
	}
}
