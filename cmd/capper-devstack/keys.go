package main

// capper-devstack drop-keys: remove a run's keys from the local Redis Cluster (scripts/demo.sh at its end), so
// that every run of a benchmark starts from the same keyspace: a demo of 1M jobs leaves ~250k logs with TTLs of
// days, and a keyspace that keeps growing makes later rounds pay for the nodes' dict resizes.

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"strings"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
)

// dropKeys unlinks every key that starts with -prefix on every master, 1,000 per pipeline, and prints how many.
func dropKeys(args []string) error {
	fs := flag.NewFlagSet("drop-keys", flag.ExitOnError)
	addrs := fs.String("addrs", "127.0.0.1:7000", "comma-separated Redis Cluster nodes")
	prefix := fs.String("prefix", "", "the keys' prefix (required; a run's key_prefix)")
	_ = fs.Parse(args)
	if *prefix == "" || strings.ContainsAny(*prefix, "*?[\\") {
		return errors.New("drop-keys: -prefix is required, without glob characters")
	}
	ctx := context.Background()
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: strings.Split(*addrs, ",")})
	defer rdb.Close()
	var dropped atomic.Int64
	err := rdb.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
		it := c.Scan(ctx, 0, *prefix+"*", 1000).Iterator()
		p := c.Pipeline()
		for it.Next(ctx) {
			p.Unlink(ctx, it.Val()) // one key per command: a node refuses keys of several slots in one
			if p.Len() == 1000 {
				if _, err := p.Exec(ctx); err != nil {
					return err
				}
				dropped.Add(1000)
			}
		}
		n := p.Len()
		if _, err := p.Exec(ctx); err != nil && n > 0 {
			return err
		}
		dropped.Add(int64(n))
		return it.Err()
	})
	if err != nil {
		return fmt.Errorf("drop-keys: %w", err)
	}
	fmt.Printf("dropped %d keys of %s*\n", dropped.Load(), *prefix)
	return nil
}
