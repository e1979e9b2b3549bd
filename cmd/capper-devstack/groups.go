package main

// capper-devstack wait-groups: wait until a run's consumer groups have settled (scripts/demo.sh before it
// produces). Workers that start together join each of their groups (the input's
// and one per delay tier) one after another, and every join is a rebalance: a burst produced while they
// still come redelivers the tiers' messages in flight to their new owners, which decide them again as
// duplicates. A benchmark of steady behaviour waits for this; one of a rebalance's cost (a SIGKILL) makes it.

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"strings"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/internal/config"
	"github.com/capper-dev/capper/internal/daemon"
)

// waitGroups waits until every group a worker of -config joins (with the CAPPER_* overrides of the
// environment: a run's group_id) is stable with -members members, each with partitions assigned. A group
// not created yet (no reader of it has joined) counts as not settled.
func waitGroups(args []string) error {
	fs := flag.NewFlagSet("wait-groups", flag.ExitOnError)
	brokers := fs.String("brokers", "127.0.0.1:9092", "bootstrap address of the (plain) broker")
	path := fs.String("config", "", "the workers' configuration (required): their groups")
	members := fs.Int("members", 1, "the members each group must have")
	timeout := fs.Duration("timeout", 60*time.Second, "how long to wait")
	_ = fs.Parse(args)
	if *path == "" {
		return errors.New("wait-groups: -config is required")
	}
	cfg, err := config.Load(*path)
	if err != nil {
		return fmt.Errorf("wait-groups: %w", err)
	}
	groups, err := daemon.Groups(cfg)
	if err != nil {
		return fmt.Errorf("wait-groups: %w", err)
	}
	client := &kafka.Client{Addr: kafka.TCP(strings.Split(*brokers, ",")...), Timeout: 10 * time.Second}
	start := time.Now()
	last := "no answer yet"
	for time.Since(start) < *timeout {
		ok, state, err := groupsSettled(client, groups, *members)
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
	return fmt.Errorf("wait-groups: the groups %s did not settle within %v (last: %s)", strings.Join(groups, ", "), *timeout, last)
}

// groupsSettled reports whether every one of groups is stable with n members holding partitions, and says
// what it saw.
func groupsSettled(client *kafka.Client, groups []string, n int) (bool, string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := client.DescribeGroups(ctx, &kafka.DescribeGroupsRequest{GroupIDs: groups})
	if err != nil {
		return false, "", err
	}
	if len(res.Groups) != len(groups) {
		return false, fmt.Sprintf("%d groups described of %d", len(res.Groups), len(groups)), nil
	}
	for _, g := range res.Groups {
		if g.Error != nil { // a group not created yet, on a broker that says so; polled again
			return false, "", fmt.Errorf("group %s: %w", g.GroupID, g.Error)
		}
		assigned := 0
		for _, m := range g.Members {
			for _, tp := range m.MemberAssignments.Topics {
				if len(tp.Partitions) > 0 {
					assigned++
					break
				}
			}
		}
		// A group not created yet is Dead with no member, on a broker that does not say so otherwise.
		if g.GroupState != "Stable" || len(g.Members) != n || assigned != n {
			return false, fmt.Sprintf("group %s: %s, %d members, %d with partitions", g.GroupID, g.GroupState, len(g.Members), assigned), nil
		}
	}
	return true, fmt.Sprintf("%d groups stable with %d members each", len(res.Groups), n), nil
}
