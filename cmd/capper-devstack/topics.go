package main

// capper-devstack drop-topics: delete a run's topics from the local broker (scripts/demo.sh at its end). Every
// demo or benchmark run creates its own topics, and the dev stack's broker keeps its data across restarts: a
// few days of benchmarks had filled the disk with 73 GB of old runs' topics.

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

// dropTopics deletes every topic whose name starts with -prefix and prints how many.
func dropTopics(args []string) error {
	fs := flag.NewFlagSet("drop-topics", flag.ExitOnError)
	brokers := fs.String("brokers", "127.0.0.1:9092", "bootstrap address of the (plain) broker")
	prefix := fs.String("prefix", "", "the topics' prefix (required; a run's topics share it)")
	timeout := fs.Duration("timeout", 60*time.Second, "how long the whole deletion may take")
	_ = fs.Parse(args)
	if *prefix == "" {
		return errors.New("drop-topics: -prefix is required")
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	client := &kafka.Client{Addr: kafka.TCP(strings.Split(*brokers, ",")...), Timeout: *timeout}
	meta, err := client.Metadata(ctx, &kafka.MetadataRequest{})
	if err != nil {
		return fmt.Errorf("drop-topics: %w", err)
	}
	var names []string
	for _, t := range meta.Topics {
		if strings.HasPrefix(t.Name, *prefix) {
			names = append(names, t.Name)
		}
	}
	sort.Strings(names)
	if len(names) > 0 {
		res, err := client.DeleteTopics(ctx, &kafka.DeleteTopicsRequest{Topics: names})
		if err != nil {
			return fmt.Errorf("drop-topics: %w", err)
		}
		var errs []error
		for _, name := range names {
			if err := res.Errors[name]; err != nil && !errors.Is(err, kafka.UnknownTopicOrPartition) {
				errs = append(errs, fmt.Errorf("%s: %w", name, err))
			}
		}
		if err := errors.Join(errs...); err != nil {
			return fmt.Errorf("drop-topics: %w", err)
		}
	}
	fmt.Printf("dropped %d topics of %s*\n", len(names), *prefix)
	return nil
}
