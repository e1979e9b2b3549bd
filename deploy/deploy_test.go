// Package deploy_test checks the deployment files: the Kubernetes manifests
// decode strictly into the API types (an unknown or misspelt field fails),
// the configuration in the ConfigMap loads with capper's own loader, and the
// files agree with each other and with that configuration. The dashboard and
// alerts are checked against a running worker's metrics in internal/daemon.
package deploy_test

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"sigs.k8s.io/yaml"

	"github.com/capper-dev/capper/internal/config"
)

const dir = "kubernetes"

// KEDA's types (keda.sh/v1alpha1), the fields these manifests may use; the
// strict decoder rejects any other.
type scaledObject struct {
	APIVersion string            `json:"apiVersion"`
	Kind       string            `json:"kind"`
	Metadata   map[string]string `json:"metadata"`
	Spec       struct {
		ScaleTargetRef  struct{ Name string } `json:"scaleTargetRef"`
		PollingInterval int                   `json:"pollingInterval"`
		CooldownPeriod  int                   `json:"cooldownPeriod"`
		MinReplicaCount int                   `json:"minReplicaCount"`
		MaxReplicaCount int                   `json:"maxReplicaCount"`
		Advanced        struct {
			HorizontalPodAutoscalerConfig struct {
				Behavior map[string]any `json:"behavior"`
			} `json:"horizontalPodAutoscalerConfig"`
		} `json:"advanced"`
		Triggers []struct {
			Type              string                `json:"type"`
			Metadata          map[string]string     `json:"metadata"`
			AuthenticationRef struct{ Name string } `json:"authenticationRef"`
		} `json:"triggers"`
	} `json:"spec"`
}

type triggerAuthentication struct {
	APIVersion string            `json:"apiVersion"`
	Kind       string            `json:"kind"`
	Metadata   map[string]string `json:"metadata"`
	Spec       struct {
		SecretTargetRef []struct{ Parameter, Name, Key string } `json:"secretTargetRef"`
	} `json:"spec"`
}

type kustomization struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Labels     []struct {
		Pairs map[string]string `json:"pairs"`
	} `json:"labels"`
	Resources []string                        `json:"resources"`
	Images    []struct{ Name, NewTag string } `json:"images"`
}

// manifests holds every object of the kustomization, decoded strictly.
type manifests struct {
	deployment appsv1.Deployment
	configMap  corev1.ConfigMap
	pdb        policyv1.PodDisruptionBudget
	scaled     scaledObject
	auth       triggerAuthentication
	kinds      []string
	kust       kustomization
}

func strict(t *testing.T, file string, doc []byte, into any) {
	t.Helper()
	if err := yaml.UnmarshalStrict(doc, into); err != nil {
		t.Fatalf("%s: %v", file, err)
	}
}

func load(t *testing.T) *manifests {
	t.Helper()
	m := &manifests{}
	b, err := os.ReadFile(filepath.Join(dir, "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	strict(t, "kustomization.yaml", b, &m.kust)
	listed := map[string]bool{"kustomization.yaml": true}
	for _, r := range m.kust.Resources {
		listed[r] = true
		b, err := os.ReadFile(filepath.Join(dir, r))
		if err != nil {
			t.Fatalf("kustomization resource %s: %v", r, err)
		}
		for _, doc := range bytes.Split(b, []byte("\n---\n")) {
			var head struct{ APIVersion, Kind string }
			if err := yaml.Unmarshal(doc, &head); err != nil {
				t.Fatalf("%s: %v", r, err)
			}
			m.kinds = append(m.kinds, head.APIVersion+" "+head.Kind)
			switch head.APIVersion + " " + head.Kind {
			case "apps/v1 Deployment":
				strict(t, r, doc, &m.deployment)
			case "v1 ConfigMap":
				strict(t, r, doc, &m.configMap)
			case "policy/v1 PodDisruptionBudget":
				strict(t, r, doc, &m.pdb)
			case "keda.sh/v1alpha1 ScaledObject":
				strict(t, r, doc, &m.scaled)
			case "keda.sh/v1alpha1 TriggerAuthentication":
				strict(t, r, doc, &m.auth)
			default:
				t.Errorf("%s: unexpected object %s %s", r, head.APIVersion, head.Kind)
			}
		}
	}
	files, _ := filepath.Glob(filepath.Join(dir, "*.yaml"))
	for _, f := range files {
		if !listed[filepath.Base(f)] {
			t.Errorf("%s is not in kustomization.yaml's resources", f)
		}
	}
	return m
}

// capperConfig loads the ConfigMap's capper.yaml with capper's own loader
// (the passwords from the environment, as the files are not here).
func capperConfig(t *testing.T, m *manifests) *config.Config {
	t.Helper()
	data, ok := m.configMap.Data["capper.yaml"]
	if !ok {
		t.Fatal("the ConfigMap has no capper.yaml")
	}
	env := map[string]string{"CAPPER_REDIS_PASSWORD": "x", "CAPPER_KAFKA_SASL_PASSWORD": "x"}
	cfg, err := config.Parse([]byte(data), func(k string) (string, bool) { v, ok := env[k]; return v, ok })
	if err != nil {
		t.Fatalf("the ConfigMap's capper.yaml does not load: %v", err)
	}
	return cfg
}

func TestManifests(t *testing.T) {
	m := load(t)
	want := []string{"v1 ConfigMap", "apps/v1 Deployment", "policy/v1 PodDisruptionBudget", "keda.sh/v1alpha1 ScaledObject", "keda.sh/v1alpha1 TriggerAuthentication"}
	if strings.Join(m.kinds, ",") != strings.Join(want, ",") {
		t.Errorf("objects %v, want %v", m.kinds, want)
	}
	cfg := capperConfig(t, m)
	d := m.deployment
	pod := d.Spec.Template.Spec
	if len(pod.Containers) != 1 {
		t.Fatalf("%d containers, want 1", len(pod.Containers))
	}
	c := pod.Containers[0]

	t.Run("image", func(t *testing.T) {
		if len(m.kust.Images) != 1 || !strings.HasPrefix(c.Image, m.kust.Images[0].Name+":") {
			t.Errorf("image %s is not the kustomization's %v", c.Image, m.kust.Images)
		}
	})
	t.Run("config mounted in place", func(t *testing.T) { checkMounts(t, m, cfg, pod, c) })
	t.Run("probes and shutdown", func(t *testing.T) {
		_, port, _ := strings.Cut(cfg.MetricsAddr, ":")
		var metricsPort string
		for _, p := range c.Ports {
			if p.Name == "metrics" {
				metricsPort = strconv.Itoa(int(p.ContainerPort))
			}
		}
		if metricsPort != port {
			t.Errorf("container port metrics %s, metrics_addr %s", metricsPort, cfg.MetricsAddr)
		}
		for name, p := range map[string]*corev1.Probe{"readiness": c.ReadinessProbe, "liveness": c.LivenessProbe, "startup": c.StartupProbe} {
			want := "/healthz"
			if name == "readiness" {
				want = "/readyz"
			}
			if p == nil || p.HTTPGet == nil || p.HTTPGet.Path != want || p.HTTPGet.Port.String() != "metrics" {
				t.Errorf("%s probe %+v, want GET %s on the metrics port", name, p, want)
			}
		}
		start := time.Duration(c.StartupProbe.PeriodSeconds*c.StartupProbe.FailureThreshold) * time.Second
		if start < 2*time.Minute {
			t.Errorf("the startup probe gives up after %v, before segments.startup_timeout's default 2m", start)
		}
		grace := time.Duration(*pod.TerminationGracePeriodSeconds) * time.Second
		if need := time.Duration(cfg.ShutdownTimeout) + 10*time.Second; grace < need {
			t.Errorf("terminationGracePeriodSeconds %v < shutdown_timeout + 10s for leaving the group (%v)", grace, need)
		}
	})
	t.Run("resources and security", func(t *testing.T) {
		req, lim := c.Resources.Requests.Memory(), c.Resources.Limits.Memory()
		if req.Value() < 640<<20 || lim.Cmp(*req) < 0 {
			t.Errorf("memory request %v, limit %v: want at least 640Mi (segments 136 MB twice while reloading, near cache ~260 MB at its default, buffers ~100 MB) and limit >= request", req, lim)
		}
		if c.Resources.Requests.Cpu().MilliValue() < 500 {
			t.Errorf("cpu request %v, want at least 500m", c.Resources.Requests.Cpu())
		}
		if pod.SecurityContext == nil || pod.SecurityContext.RunAsNonRoot == nil || !*pod.SecurityContext.RunAsNonRoot {
			t.Error("the pod may run as root")
		}
		memEnv := false
		for _, e := range c.Env {
			if e.Name == "GOMEMLIMIT" && e.ValueFrom != nil && e.ValueFrom.ResourceFieldRef != nil && e.ValueFrom.ResourceFieldRef.Resource == "limits.memory" {
				memEnv = true
			}
		}
		if !memEnv {
			t.Error("GOMEMLIMIT does not follow the memory limit")
		}
	})
	t.Run("selectors", func(t *testing.T) {
		for k, v := range d.Spec.Selector.MatchLabels {
			if d.Spec.Template.Labels[k] != v || m.pdb.Spec.Selector.MatchLabels[k] != v {
				t.Errorf("label %s=%s: pod template %q, PDB %q", k, v, d.Spec.Template.Labels[k], m.pdb.Spec.Selector.MatchLabels[k])
			}
		}
		if m.pdb.Spec.MaxUnavailable == nil || m.pdb.Spec.MaxUnavailable.IntValue() != 1 {
			t.Errorf("PDB maxUnavailable %v, want 1", m.pdb.Spec.MaxUnavailable)
		}
	})
	t.Run("autoscaling on lag", func(t *testing.T) { checkAutoscaling(t, m, cfg, &d) })
}

// TestDockerfileUsesTheReleaseBuild: the image is built by scripts/build.sh
// (what `make build` and the build test run) and runs as a non-root user.
func TestDockerfileUsesTheReleaseBuild(t *testing.T) {
	b, err := os.ReadFile("../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	df := string(b)
	for _, re := range []string{`(?m)^RUN .*scripts/build\.sh /out/capper`, `(?m)^FROM gcr\.io/distroless/static[^ ]*:nonroot$`,
		`(?m)^USER 65532:65532$`, `(?m)^ENTRYPOINT \["/capper"\]$`} {
		if !regexp.MustCompile(re).MatchString(df) {
			t.Errorf("Dockerfile does not match %s", re)
		}
	}
}

// checkMounts: the config mounted as a directory (so the kubelet updates it), the
// passwords from the Secret, the cache directory on a writable volume.
func checkMounts(t *testing.T, m *manifests, cfg *config.Config, pod corev1.PodSpec, c corev1.Container) {
	t.Helper()
	mounts := map[string]corev1.VolumeMount{}
	for _, vm := range c.VolumeMounts {
		mounts[vm.Name] = vm
	}
	volumes := map[string]corev1.Volume{}
	for _, v := range pod.Volumes {
		volumes[v.Name] = v
	}
	var configPath string
	for i, a := range c.Args {
		if a == "--config" && i+1 < len(c.Args) {
			configPath = c.Args[i+1]
		}
	}
	found := false
	for name, v := range volumes {
		if v.ConfigMap != nil && v.ConfigMap.Name == m.configMap.Name {
			vm := mounts[name]
			found = true
			if vm.SubPath != "" {
				t.Errorf("the config is mounted with subPath: the kubelet never updates it, so rules never reload")
			}
			if filepath.Join(vm.MountPath, "capper.yaml") != configPath {
				t.Errorf("--config %s is not the mounted %s/capper.yaml", configPath, vm.MountPath)
			}
		}
	}
	if !found {
		t.Errorf("no volume of ConfigMap %s", m.configMap.Name)
	}
	var secretMount string
	for name, v := range volumes {
		if v.Secret != nil {
			secretMount = mounts[name].MountPath
			if v.Secret.SecretName != "capper-credentials" {
				t.Errorf("credentials from Secret %s, want capper-credentials", v.Secret.SecretName)
			}
		}
	}
	for _, f := range []string{cfg.Redis.PasswordFile, cfg.Kafka.SASLPasswordFile} {
		if secretMount == "" || !strings.HasPrefix(f, secretMount+"/") {
			t.Errorf("password file %s is not in the Secret's mount %q", f, secretMount)
		}
	}
	if c.SecurityContext == nil || c.SecurityContext.ReadOnlyRootFilesystem == nil || !*c.SecurityContext.ReadOnlyRootFilesystem {
		t.Error("the root filesystem is writable")
	}
	if cfg.Segments.CacheDir == "" {
		t.Error("segments.cache_dir is unset: the default temporary directory is on the read-only root filesystem")
	}
	writable := false
	for name, v := range volumes {
		if v.EmptyDir != nil && strings.HasPrefix(cfg.Segments.CacheDir, mounts[name].MountPath) {
			writable = true
		}
	}
	if !writable {
		t.Errorf("segments.cache_dir %s is not on a writable emptyDir", cfg.Segments.CacheDir)
	}
}

// checkAutoscaling: KEDA's Kafka trigger reads the config's brokers, group,
// topic, SASL and TLS, and its replicas fit the deployment's.
func checkAutoscaling(t *testing.T, m *manifests, cfg *config.Config, d *appsv1.Deployment) {
	t.Helper()
	s := m.scaled.Spec
	if s.ScaleTargetRef.Name != d.Name || len(s.Triggers) != 1 || s.Triggers[0].Type != "kafka" {
		t.Fatalf("ScaledObject targets %q with %d triggers, want %s and one kafka trigger", s.ScaleTargetRef.Name, len(s.Triggers), d.Name)
	}
	md := s.Triggers[0].Metadata
	for k, want := range map[string]string{
		"bootstrapServers": strings.Join(cfg.Kafka.Brokers, ","), "consumerGroup": cfg.Kafka.GroupID, "topic": cfg.Kafka.Topics.Input,
		"sasl": map[string]string{"": "none", "plain": "plaintext", "scram-sha-256": "scram_sha256", "scram-sha-512": "scram_sha512"}[cfg.Kafka.SASLMechanism], "tls": map[bool]string{true: "enable", false: "disable"}[cfg.Kafka.TLS.Enabled],
	} {
		if md[k] != want {
			t.Errorf("kafka trigger %s = %q, the config says %q", k, md[k], want)
		}
	}
	if n, err := strconv.Atoi(md["lagThreshold"]); err != nil || n < 1000 {
		t.Errorf("lagThreshold %q", md["lagThreshold"])
	}
	if s.MinReplicaCount < 1 || s.MaxReplicaCount < s.MinReplicaCount || *d.Spec.Replicas < int32(s.MinReplicaCount) {
		t.Errorf("replicas: deployment %d, KEDA %d..%d", *d.Spec.Replicas, s.MinReplicaCount, s.MaxReplicaCount)
	}
	if s.Triggers[0].AuthenticationRef.Name != m.auth.Metadata["name"] {
		t.Errorf("the trigger authenticates with %q, the TriggerAuthentication is %q", s.Triggers[0].AuthenticationRef.Name, m.auth.Metadata["name"])
	}
	for _, ref := range m.auth.Spec.SecretTargetRef {
		if ref.Name != "capper-credentials" {
			t.Errorf("KEDA reads %s from Secret %s, want capper-credentials", ref.Parameter, ref.Name)
		}
	}
}
