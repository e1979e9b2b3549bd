// Package kafkaadmin is what capper asks of a Kafka cluster's administrator,
// in one place: the topics (CreateTopics, for the local stack, loadgen
// --create-topics and the tests; capper run never creates one) and the one
// list of what capper's Kafka principal needs: the least-privilege ACLs
// docs/security.md prints as kafka-acls.sh lines, that the secured local
// stack grants on its topics (cmd/capper-devstack kafka-setup), and that the
// secured end-to-end tests create for their own topics.
package kafkaadmin

import (
	"fmt"
	"strings"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/internal/config"
)

// Names are the resources a worker uses: its consumer group, the input topic,
// the four output topics and the delay topics' prefix (delay topics are both
// written and read; each tier is read by the group GROUP.delay.TIER).
type Names struct {
	Group, Input               string
	Allowed, Capped, DLQ, Held string
	DelayPrefix                string // empty when holding is disabled
	External, Feedback         string // the event topics; empty when not configured
	Preferences                string
}

// NamesOf returns the resources of a worker with consumer group group and
// topics t; holding says whether it holds jobs on delay topics.
func NamesOf(group string, t config.Topics, holding bool) Names {
	n := Names{Group: group, Input: t.Input, Allowed: t.Allowed, Capped: t.Capped, DLQ: t.DLQ, Held: t.Held,
		External: t.External, Feedback: t.Feedback, Preferences: t.Preferences}
	if holding {
		n.DelayPrefix = t.DelayPrefix
	}
	return n
}

// Grant is one ALLOW ACL for capper's principal.
type Grant struct {
	Resource  kafka.ResourceType
	Name      string
	Pattern   kafka.PatternType
	Operation kafka.ACLOperationType
}

// Grants returns every ACL a worker needs, and nothing else:
//   - Read on the input topic and Read on its group (fetch, join, sync,
//     heartbeat, commit), Describe on both (metadata, coordinator, offsets,
//     the lag gauge);
//   - Write and Describe on each output topic;
//   - Read, Write and Describe on the topics prefixed DelayPrefix, and Read
//     and Describe on the groups prefixed GROUP.delay.;
//   - Read and Describe on the event topics, on the group GROUP.external and
//     on the groups prefixed GROUP.feedback (the shared one, and each
//     process's feedback-cache group).
//
// No Create (topics are made by the operator), no Cluster permission (the
// producer is not idempotent), no Alter or Delete.
func Grants(n Names) []Grant {
	var gs []Grant
	add := func(res kafka.ResourceType, name string, pat kafka.PatternType, ops ...kafka.ACLOperationType) {
		for _, op := range ops {
			gs = append(gs, Grant{res, name, pat, op})
		}
	}
	lit, pre := kafka.PatternTypeLiteral, kafka.PatternTypePrefixed
	read, write, describe := kafka.ACLOperationTypeRead, kafka.ACLOperationTypeWrite, kafka.ACLOperationTypeDescribe
	add(kafka.ResourceTypeTopic, n.Input, lit, read, describe)
	add(kafka.ResourceTypeGroup, n.Group, lit, read, describe)
	for _, t := range []string{n.Allowed, n.Capped, n.DLQ, n.Held} {
		if t != "" { // Kafka refuses an ACL on an empty name (a worker that holds nothing may have no held topic)
			add(kafka.ResourceTypeTopic, t, lit, write, describe)
		}
	}
	if n.DelayPrefix != "" {
		add(kafka.ResourceTypeTopic, n.DelayPrefix, pre, read, write, describe)
		add(kafka.ResourceTypeGroup, n.Group+".delay.", pre, read, describe)
	}
	if n.External != "" {
		add(kafka.ResourceTypeTopic, n.External, lit, read, describe)
		add(kafka.ResourceTypeGroup, n.Group+".external", lit, read, describe)
	}
	if n.Feedback != "" {
		add(kafka.ResourceTypeTopic, n.Feedback, lit, read, describe)
		add(kafka.ResourceTypeGroup, n.Group+".feedback", pre, read, describe)
	}
	if n.Preferences != "" {
		add(kafka.ResourceTypeTopic, n.Preferences, lit, read, describe)
		add(kafka.ResourceTypeGroup, n.Group+".preferences", pre, read, describe)
	}
	return gs
}

// Command returns the kafka-acls.sh line that creates the grants for principal
// (e.g. "User:capper"), one line per resource.
func Command(principal string, gs []Grant) []string {
	type res struct {
		kind, name, pattern string
	}
	var order []res
	ops := map[res][]string{}
	for _, g := range gs {
		r := res{strings.ToLower(g.Resource.String()), g.Name, strings.ToLower(g.Pattern.String())}
		if _, ok := ops[r]; !ok {
			order = append(order, r)
		}
		ops[r] = append(ops[r], opName(g.Operation))
	}
	var lines []string
	for _, r := range order {
		var b strings.Builder
		fmt.Fprintf(&b, "kafka-acls.sh --bootstrap-server $BROKERS --command-config admin.properties --add --allow-principal %s", principal)
		for _, op := range ops[r] {
			b.WriteString(" --operation " + op)
		}
		fmt.Fprintf(&b, " --%s %s", r.kind, r.name)
		if r.pattern == "prefixed" {
			b.WriteString(" --resource-pattern-type prefixed")
		}
		lines = append(lines, b.String())
	}
	return lines
}

func opName(op kafka.ACLOperationType) string {
	s := op.String()
	return strings.ToUpper(s[:1]) + strings.ToLower(s[1:])
}

// Entry returns g as an ALLOW entry of a CreateACLs request for principal.
func (g Grant) Entry(principal string) kafka.ACLEntry {
	return kafka.ACLEntry{
		ResourceType: g.Resource, ResourceName: g.Name, ResourcePatternType: g.Pattern,
		Principal: principal, Host: "*", Operation: g.Operation, PermissionType: kafka.ACLPermissionTypeAllow,
	}
}
