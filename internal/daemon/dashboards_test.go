package daemon_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"gopkg.in/yaml.v3"

	"github.com/capper-dev/capper/internal/testenv"
)

// exprs returns the PromQL expressions of the Grafana dashboard (with their
// legends) and of the alert rules.
func exprs(t *testing.T) map[string]string {
	t.Helper()
	out := map[string]string{} // expression -> where
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr, LegendFormat string
			} `json:"targets"`
		} `json:"panels"`
	}
	b, err := os.ReadFile("../../deploy/grafana/capper.json")
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatal(err)
	}
	for _, p := range dash.Panels {
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			out[tg.Expr+" "+tg.LegendFormat] = "panel " + p.Title
		}
	}
	var rules struct {
		Groups []struct {
			Name  string
			Rules []struct {
				Alert, Expr, For    string
				Labels, Annotations map[string]string
			}
		}
	}
	b, err = os.ReadFile("../../deploy/prometheus/capper-alerts.yaml")
	if err != nil {
		t.Fatal(err)
	}
	dec := yaml.NewDecoder(strings.NewReader(string(b)))
	dec.KnownFields(true)
	if err := dec.Decode(&rules); err != nil {
		t.Fatalf("capper-alerts.yaml: %v", err)
	}
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" || r.Expr == "" || r.Labels["severity"] == "" || r.Annotations["summary"] == "" {
				t.Errorf("alert %q: needs alert, expr, a severity label and a summary", r.Alert)
			}
			if _, err := time.ParseDuration(r.For); err != nil {
				t.Errorf("alert %s: for %q: %v", r.Alert, r.For, err)
			}
			out[r.Expr] = "alert " + r.Alert
		}
	}
	return out
}

// seriesLabels scrapes addr's /metrics: each series name with its label
// names, and the metric families.
func seriesLabels(t *testing.T, addr string) (map[string]map[string]bool, map[string]*dto.MetricFamily) {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	labels := map[string]map[string]bool{} // series name -> its label names
	for name, f := range fams {
		names := []string{name}
		if f.GetType().String() == "HISTOGRAM" {
			names = []string{name + "_bucket", name + "_sum", name + "_count"}
		}
		for _, n := range names {
			labels[n] = map[string]bool{}
			for _, m := range f.GetMetric() {
				for _, l := range m.GetLabel() {
					labels[n][l.GetName()] = true
				}
			}
		}
		if f.GetType().String() == "HISTOGRAM" {
			labels[name+"_bucket"]["le"] = true
		}
	}
	return labels, fams
}

var (
	metricRe   = regexp.MustCompile(`\bcapper_[a-z0-9_]+`)
	matchersRe = regexp.MustCompile(`\b(capper_[a-z0-9_]+)\{([^}]*)\}`)
	groupingRe = regexp.MustCompile(`\b(?:by|without) \(([^)]*)\)`)
	legendRe   = regexp.MustCompile(`\{\{ *([a-z_]+) *\}\}`)
	opRe       = regexp.MustCompile(`[=!~].*`) // a matcher's operator and value, after its label
)

// TestDashboardsAndAlertsUseExportedMetrics scrapes a worker that decided
// every kind of job (allowed, capped, shadow-capped, exempt, duplicate,
// dead-lettered) with holding on, and checks that every metric the Grafana
// dashboard and the alert rules query exists, with every label they select,
// group or print by: the files cannot drift from the code.
func TestDashboardsAndAlertsUseExportedMetrics(t *testing.T) {
	s := testenv.NewStack(t, 1, nil)
	s.EnableHold(1, "1s")
	s.EditConfig("caps: [{name: daily, window: 24h, limit: 2}]\n    - name: active",
		"caps: [{name: daily, window: 24h, limit: 2}, {name: hourly-shadow, window: 1h, limit: 1, shadow: true}]\n    - name: active")
	d, _ := startDaemon(t, s)
	jobs := []testenv.JobSpec{{ID: "a", User: 1, Channel: "email"}, {ID: "b", User: 1, Channel: "email"}, {ID: "c", User: 1, Channel: "email"},
		{ID: "t", User: 1, Channel: "email", Category: "transactional"}, {ID: "a", User: 1, Channel: "email"}}
	s.Produce(jobs)
	s.CollectJobs(jobs, 60*time.Second)
	labels, fams := seriesLabels(t, d.MetricsAddr())
	// A deployment with workspaces exports the per-workspace series too.
	ws := testenv.NewStack(t, 1, nil)
	ws.EnableWorkspaces("acme", "", testenv.Workspace{Name: "acme", Rules: "default_caps: [{name: daily, window: 24h, limit: 1}]\n"})
	wd, _ := startDaemon(t, ws)
	wjobs := []testenv.JobSpec{{ID: "w1", User: 1, Channel: "email"}, {ID: "w2", User: 1, Channel: "email", Workspace: "acme"}}
	ws.Produce(wjobs)
	ws.CollectJobs(wjobs, 60*time.Second)
	wlabels, wfams := seriesLabels(t, wd.MetricsAddr())
	mergeLabels(labels, wlabels)
	// So does one with a budget, once a send was held for its token and
	// claimed it: two SMS under a budget of one a second.
	bs := testenv.NewStack(t, 1, nil)
	bs.EnableHold(1, "100ms", "1s")
	bs.EditConfig("  exempt_categories: [transactional]\n", "  exempt_categories: [transactional]\n  budgets: [{name: sms, channel: sms, limit: 1, window: 1s, max_hold: 1m}]\n")
	bd, _ := startDaemon(t, bs)
	bjobs := []testenv.JobSpec{{ID: "s1", User: 1, Channel: "sms"}, {ID: "s2", User: 2, Channel: "sms"}}
	bs.Produce(bjobs)
	bs.CollectJobs(bjobs, 60*time.Second)
	blabels, bfams := seriesLabels(t, bd.MetricsAddr())
	mergeLabels(labels, blabels)
	all := exprs(t)
	if len(all) < 15 {
		t.Fatalf("only %d expressions in the dashboard and alerts", len(all))
	}
	for expr, where := range all {
		used := metricRe.FindAllString(expr, -1)
		if len(used) == 0 {
			t.Errorf("%s: %q queries no capper metric", where, expr)
		}
		for _, m := range used {
			if labels[m] == nil {
				t.Errorf("%s: metric %s is not exported (%q)", where, m, expr)
			}
		}
		has := func(label string) bool {
			for _, m := range used {
				if labels[m][label] {
					return true
				}
			}
			return false
		}
		for _, mm := range matchersRe.FindAllStringSubmatch(expr, -1) {
			for _, matcher := range strings.Split(mm[2], ",") {
				name := strings.TrimSpace(opRe.ReplaceAllString(matcher, ""))
				if name != "" && !labels[mm[1]][name] {
					t.Errorf("%s: %s has no label %q (%q)", where, mm[1], name, expr)
				}
			}
		}
		var grouped []string
		for _, g := range groupingRe.FindAllStringSubmatch(expr, -1) {
			grouped = append(grouped, strings.Split(g[1], ",")...)
		}
		for _, l := range legendRe.FindAllStringSubmatch(expr, -1) {
			grouped = append(grouped, l[1])
		}
		for _, g := range grouped {
			if g = strings.TrimSpace(g); !has(g) {
				t.Errorf("%s: no metric of %q has the label %q", where, expr, g)
			}
		}
	}
	// The figures behind the panels: the decisions made, by cap.
	for _, series := range []string{`capper_capped_total{cap="daily"}`, `capper_shadow_capped_total{cap="hourly-shadow"}`, `capper_jobs_total{decision="duplicate"}`, `capper_ready`} {
		if v := sample(fams, series); v < 1 {
			t.Errorf("%s = %v, want at least 1", series, v)
		}
	}
	if v := sample(wfams, `capper_workspace_jobs_total{decision="capped",workspace="acme"}`); v != 1 {
		t.Errorf("acme's capped jobs = %v, want 1 (two sends to user 1 under a daily cap of 1, one naming no workspace)", v)
	}
	if v := sample(bfams, `capper_budget_claims_total{budget="sms",result="made"}`); v != 1 {
		t.Errorf("the budget's claims made = %v, want 1 (two SMS under one a second: the second held, then claiming its token)", v)
	}
}

// mergeLabels adds more's series and their label names to labels.
func mergeLabels(labels, more map[string]map[string]bool) {
	for name, ls := range more {
		if labels[name] == nil {
			labels[name] = map[string]bool{}
		}
		for l := range ls {
			labels[name][l] = true
		}
	}
}

// sample returns the value of one series, written name{label="value"}, or -1.
func sample(fams map[string]*dto.MetricFamily, series string) float64 {
	name, sel, _ := strings.Cut(strings.TrimSuffix(series, "}"), "{")
	f, ok := fams[name]
	if !ok {
		return -1
	}
	for _, m := range f.GetMetric() {
		var ls []string
		for _, l := range m.GetLabel() {
			ls = append(ls, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
		}
		if strings.Join(ls, ",") == sel {
			switch {
			case m.GetCounter() != nil:
				return m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				return m.GetGauge().GetValue()
			}
		}
	}
	return -1
}
