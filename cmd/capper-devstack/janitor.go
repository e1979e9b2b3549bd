package main

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// janitor works around a kfake defect: a group member that dies while its
// JoinGroup is pending is never expired. kfake arms a member's session timer
// only after its JoinGroup reply was written, and the reply to a dead
// connection is not, so the member stays in the group, Stable, holding its
// partitions, and nobody consumes them. Real Kafka expires it after its
// session timeout.
//
// The janitor watches the requests that prove a member alive (JoinGroup with a
// member id, SyncGroup, Heartbeat, OffsetCommit) and, once a second, the
// groups' members. A member silent for longer than the longest session or
// rebalance timeout its group asked for (plus a margin) is removed with a
// LeaveGroup on its behalf, which is what Kafka's expiry amounts to.
type janitor struct {
	log    *slog.Logger
	client *kgo.Client

	mu      sync.Mutex
	seen    map[member]time.Time
	timeout map[string]time.Duration // by group
}

type member struct{ group, id string }

// expiryMargin is added to a group's timeout before a silent member is removed.
const expiryMargin = 2 * time.Second

func startJanitor(ctx context.Context, cluster *kfake.Cluster, admin []kgo.Opt, log *slog.Logger) error {
	client, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(cluster.ListenAddrs()...)}, admin...)...)
	if err != nil {
		return err
	}
	j := &janitor{log: log, client: client, seen: map[member]time.Time{}, timeout: map[string]time.Duration{}}
	cluster.Control(j.observe)
	go func() {
		defer client.Close()
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				j.sweep(ctx, time.Now())
			}
		}
	}()
	return nil
}

// observe records signs of life; it never handles a request.
func (j *janitor) observe(req kmsg.Request) (kmsg.Response, error, bool) {
	now := time.Now()
	j.mu.Lock()
	defer j.mu.Unlock()
	switch r := req.(type) {
	case *kmsg.JoinGroupRequest:
		d := time.Duration(max(r.SessionTimeoutMillis, r.RebalanceTimeoutMillis)) * time.Millisecond
		j.timeout[r.Group] = max(j.timeout[r.Group], d)
		if r.MemberID != "" {
			j.seen[member{r.Group, r.MemberID}] = now
		}
	case *kmsg.SyncGroupRequest:
		j.seen[member{r.Group, r.MemberID}] = now
	case *kmsg.HeartbeatRequest:
		j.seen[member{r.Group, r.MemberID}] = now
	case *kmsg.OffsetCommitRequest:
		if r.MemberID != "" {
			j.seen[member{r.Group, r.MemberID}] = now
		}
	}
	return nil, nil, false
}

// sweep removes the members that have been silent for too long.
func (j *janitor) sweep(ctx context.Context, now time.Time) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	list, err := kmsg.NewPtrListGroupsRequest().RequestWith(ctx, j.client)
	if err != nil || len(list.Groups) == 0 {
		return
	}
	describe := kmsg.NewPtrDescribeGroupsRequest()
	for _, g := range list.Groups {
		describe.Groups = append(describe.Groups, g.Group)
	}
	groups, err := describe.RequestWith(ctx, j.client)
	if err != nil {
		return
	}
	for _, g := range groups.Groups {
		var expired []string
		j.mu.Lock()
		limit := j.timeout[g.Group]
		if limit == 0 {
			limit = 45 * time.Second // Kafka's default rebalance timeout, when no join was seen
		}
		for _, m := range g.Members {
			k := member{g.Group, m.MemberID}
			last, ok := j.seen[k]
			if !ok {
				j.seen[k] = now // first sight: count from now
				continue
			}
			if now.Sub(last) > limit+expiryMargin {
				expired = append(expired, m.MemberID)
				delete(j.seen, k)
			}
		}
		j.mu.Unlock()
		if len(expired) == 0 {
			continue
		}
		leave := kmsg.NewPtrLeaveGroupRequest()
		leave.Group = g.Group
		for _, id := range expired {
			m := kmsg.NewLeaveGroupRequestMember()
			m.MemberID = id
			leave.Members = append(leave.Members, m)
		}
		if _, err := leave.RequestWith(ctx, j.client); err != nil {
			j.log.Warn("janitor: removing silent group members failed", "group", g.Group, "members", expired, "err", err)
			continue
		}
		j.log.Info("janitor: removed group members silent for longer than their session (kfake does not expire them)", "group", g.Group, "members", expired, "timeout", limit+expiryMargin)
	}
}
