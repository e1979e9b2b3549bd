package main

// capper-devstack wait-groups: wait until a run's consumer groups have settled (scripts/demo.sh before it
// produces, with more than one worker). Workers that start together join each of their groups (the input's
// and one per delay tier) one after another, and every join is a rebalance: a burst produced while they
// still come redelivers the tiers' messages in flight to their new owners, which decide them again as
// duplicates. A benchmark of steady behaviour waits for this; one of a rebalance's cost (a SIGKILL) makes it.

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/segmentio/kafka-go"
)

// waitGroups waits until every group whose id starts with -prefix (but the event caches' own groups) is
// stable with -members members, each with partitions assigned.
func waitGroups(args []string) error {
	fs := flag.NewFlagSet("wait-groups", flag.ExitOnError)
	brokers := fs.String("brokers", "127.0.0.1:9092", "bootstrap address of the (plain) broker")
	prefix := fs.String("prefix", "", "the groups' prefix (required: a run's group_id)")
	members := fs.Int("members", 1, "the members each group must have")
	timeout := fs.Duration("timeout", 60*time.Second, "how long to wait")
	_ = fs.Parse(args)
	if *prefix == "" {
		return errors.New("wait-groups: -prefix is required")
	}
	client := &kafka.Client{Addr: kafka.TCP(strings.Split(*brokers, ",")...), Timeout: 10 * time.Second}
	start := time.Now()
	last := "no group yet"
	for time.Since(start) < *timeout {
		ok, state, err := groupsSettled(client, *prefix, *members)
		switch {
		case err != nil:
			last = err.Error()
		case ok:
			fmt.Printf("%s in %.1f s\n", state, time.Since(start).Seconds())
			return nil
		default:
			last = state
		}
		time.Sleep(200 * time.Millisecond)
	}
	return fmt.Errorf("wait-groups: the groups of %s* did not settle within %v (last: %s)", *prefix, *timeout, last)
}

// groupsSettled reports whether every group of prefix is stable with n members holding partitions, and
// says what it saw.
func groupsSettled(client *kafka.Client, prefix string, n int) (bool, string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	list, err := client.ListGroups(ctx, &kafka.ListGroupsRequest{})
	if err != nil {
		return false, "", err
	}
	var ids []string
	for _, g := range list.Groups {
		if (g.GroupID == prefix || strings.HasPrefix(g.GroupID, prefix+".")) && !strings.Contains(g.GroupID, "-cache.") {
			ids = append(ids, g.GroupID)
		}
	}
	if len(ids) == 0 {
		return false, "no group yet", nil
	}
	sort.Strings(ids)
	res, err := client.DescribeGroups(ctx, &kafka.DescribeGroupsRequest{GroupIDs: ids})
	if err != nil {
		return false, "", err
	}
	for _, g := range res.Groups {
		assigned := 0
		for _, m := range g.Members {
			for _, tp := range m.MemberAssignments.Topics {
				if len(tp.Partitions) > 0 {
					assigned++
					break
				}
			}
		}
		if g.GroupState != "Stable" || len(g.Members) != n || assigned != n {
			return false, fmt.Sprintf("group %s: %s, %d members, %d with partitions", g.GroupID, g.GroupState, len(g.Members), assigned), nil
		}
	}
	return true, fmt.Sprintf("%d groups stable with %d members each", len(res.Groups), n), nil
}
