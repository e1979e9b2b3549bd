package daemon

import (
	"context"
	"net"
	"sync"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/protocol/metadata"
)

// partitionCountTTL is how long a writer reuses the metadata of a topic:
// on top of the transport's own cache (6 s, refreshed from the brokers), so
// a topic's new partitions reach the writers at most this much later.
const partitionCountTTL = time.Second

// partitionCounts is one writer's transport, which answers a metadata
// request of a single topic from the last answer for up to
// partitionCountTTL. kafka-go's Writer asks for the topic's metadata once
// per message, to count its partitions for the balancer (Writer.partitions),
// and the transport, though it answers from its own cache, copies the topic's
// metadata into a new response each time: 3 to 5% of a worker's CPU in a
// blast's profile (capper and the pass-through alike). The writer only reads
// the response. An answer with an error (a topic unknown, or its leader
// moving) is never kept: the next message asks again.
type partitionCounts struct {
	kafka.RoundTripper
	mu   sync.Mutex
	last map[partitionQuery]partitionAnswer
}

type partitionQuery struct {
	topic  string
	create bool
}

type partitionAnswer struct {
	resp  *metadata.Response
	until time.Time
}

func newPartitionCounts(rt kafka.RoundTripper) *partitionCounts {
	return &partitionCounts{RoundTripper: rt, last: map[partitionQuery]partitionAnswer{}}
}

func (p *partitionCounts) RoundTrip(ctx context.Context, addr net.Addr, req kafka.Request) (kafka.Response, error) {
	m, ok := req.(*metadata.Request)
	if !ok || len(m.TopicNames) != 1 {
		return p.RoundTripper.RoundTrip(ctx, addr, req)
	}
	q, now := partitionQuery{m.TopicNames[0], m.AllowAutoTopicCreation}, time.Now()
	p.mu.Lock()
	a, hit := p.last[q]
	p.mu.Unlock()
	if hit && now.Before(a.until) {
		return a.resp, nil
	}
	resp, err := p.RoundTripper.RoundTrip(ctx, addr, req)
	if r, ok := resp.(*metadata.Response); err == nil && ok && answered(r, q.topic) {
		p.mu.Lock()
		p.last[q] = partitionAnswer{r, now.Add(partitionCountTTL)}
		p.mu.Unlock()
	}
	return resp, err
}

// answered reports whether r has topic's metadata without an error, for it
// and for each of its partitions.
func answered(r *metadata.Response, topic string) bool {
	found := false
	for _, t := range r.Topics {
		if t.Name != topic {
			continue
		}
		if t.ErrorCode != 0 || len(t.Partitions) == 0 {
			return false
		}
		for _, pt := range t.Partitions {
			if pt.ErrorCode != 0 {
				return false
			}
		}
		found = true
	}
	return found
}
