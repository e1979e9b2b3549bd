package kafkaadmin

import (
	"os"
	"strings"
	"testing"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/internal/config"
)

func TestGrantsAreLeastPrivilege(t *testing.T) {
	gs := Grants(NamesOf("capper", config.DefaultTopics, true))
	ops := map[string]map[kafka.ACLOperationType]bool{}
	for _, g := range gs {
		k := strings.ToUpper(g.Resource.String()) + " " + g.Name + " " + strings.ToUpper(g.Pattern.String())
		if ops[k] == nil {
			ops[k] = map[kafka.ACLOperationType]bool{}
		}
		ops[k][g.Operation] = true
		switch g.Operation {
		case kafka.ACLOperationTypeRead, kafka.ACLOperationTypeWrite, kafka.ACLOperationTypeDescribe:
		default:
			t.Errorf("%s: operation %s is more than a worker needs", k, g.Operation)
		}
		if g.Resource == kafka.ResourceTypeCluster {
			t.Errorf("a cluster grant: %+v", g)
		}
	}
	want := map[string]string{
		"TOPIC sends LITERAL":          "READ DESCRIBE",
		"GROUP capper LITERAL":         "READ DESCRIBE",
		"TOPIC sends.allowed LITERAL":  "WRITE DESCRIBE",
		"TOPIC sends.capped LITERAL":   "WRITE DESCRIBE",
		"TOPIC sends.dlq LITERAL":      "WRITE DESCRIBE",
		"TOPIC sends.held LITERAL":     "WRITE DESCRIBE",
		"TOPIC sends.delay. PREFIXED":  "READ WRITE DESCRIBE",
		"GROUP capper.delay. PREFIXED": "READ DESCRIBE",
	}
	if len(ops) != len(want) {
		t.Errorf("%d resources granted, want %d: %v", len(ops), len(want), ops)
	}
	for k, w := range want {
		for _, op := range strings.Fields(w) {
			var o kafka.ACLOperationType
			if err := o.UnmarshalText([]byte(op)); err != nil {
				t.Fatal(err)
			}
			if !ops[k][o] {
				t.Errorf("%s: no %s grant", k, op)
			}
		}
		if len(ops[k]) != len(strings.Fields(w)) {
			t.Errorf("%s: %d operations, want %s", k, len(ops[k]), w)
		}
	}
	if n := len(Grants(NamesOf("capper", config.DefaultTopics, false))); n != len(gs)-5 {
		t.Errorf("without holding %d grants, want %d (no delay topics or groups)", n, len(gs)-5)
	}
}

// TestDocsPrintTheGrants: the kafka-acls.sh lines in docs/security.md are these grants.
func TestDocsPrintTheGrants(t *testing.T) {
	readme, err := os.ReadFile("../../docs/security.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range Command("User:capper", Grants(NamesOf(config.DefaultGroupID, config.DefaultTopics, true))) {
		if !strings.Contains(string(readme), line) {
			t.Errorf("docs/security.md lacks the line\n%s", line)
		}
	}
}
