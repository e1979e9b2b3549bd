package output_test

import (
	"fmt"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/output"
)

// A delivery service reads capper's allowed topic and acts on what capper
// says of each send; a capped-topic consumer can tell a send refused for good
// from one that may be sent again later.
func ExampleParse() {
	msg := kafka.Message{
		Key:   []byte("123"),
		Value: []byte(`{"job_id":"cmp-42:user-123:email","user_id":123,"campaign_id":"cmp-42","channel":"email"}`),
		Headers: []kafka.Header{
			{Key: output.HeaderDecision, Value: []byte("capped")},
			{Key: output.HeaderCap, Value: []byte("daily")},
			{Key: output.HeaderRetryAt, Value: []byte("2026-11-28T09:00:00Z")},
			{Key: output.HeaderSegment, Value: []byte("active")},
			{Key: output.HeaderDecidedAt, Value: []byte("2026-11-27T15:00:00.000Z")},
			{Key: output.HeaderPriority, Value: []byte("0")},
		},
	}
	o, err := output.Parse(msg.Headers)
	if err != nil {
		fmt.Println("not a capper output:", err)
		return
	}
	switch {
	case o.Decision == output.DecisionCapped && o.RetryAt.IsZero():
		fmt.Printf("capped for good by %s\n", o.Cap)
	case o.Decision == output.DecisionCapped:
		fmt.Printf("capped by %s (segment %s) until %s\n", o.Cap, o.Segment, o.RetryAt.Format("2006-01-02 15:04 MST"))
	default:
		fmt.Println(o.Decision)
	}
	// Output: capped by daily (segment active) until 2026-11-28 09:00 UTC
}
