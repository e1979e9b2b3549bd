package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/sasl/scram"

	"github.com/capper-dev/capper/internal/config"
	"github.com/capper-dev/capper/internal/kafkaadmin"
)

// kafkaSetup creates the stack's topics on a broker that has just started
// (retrying while it finishes starting) and, on the secured broker, grants
// the user of -grant capper's ACLs on the default topics and group.
func kafkaSetup(args []string) error {
	fs := flag.NewFlagSet("kafka-setup", flag.ExitOnError)
	brokers := fs.String("brokers", "127.0.0.1:9092", "bootstrap address of the broker")
	topics := fs.String("topics", "", "comma-separated topics to create when missing (Required)")
	partitions := fs.Int("partitions", 6, "partitions of each created topic")
	ca := fs.String("ca", "", "CA (PEM) of the broker's certificate; enables TLS")
	user := fs.String("sasl-user", "", "SCRAM-SHA-512 user with the right to create topics and ACLs (a super user)")
	passwordFile := fs.String("sasl-password-file", "", "file holding -sasl-user's password")
	grant := fs.String("grant", "", "user granted capper's ACLs (internal/kafkaadmin) on the default topics and group "+config.DefaultGroupID)
	timeout := fs.Duration("timeout", 60*time.Second, "how long to retry while the broker is starting")
	_ = fs.Parse(args)
	if *topics == "" {
		return fmt.Errorf("-topics is required")
	}
	if *partitions < 1 {
		return fmt.Errorf("-partitions must be at least 1, got %d", *partitions)
	}

	dialer := &kafka.Dialer{Timeout: 10 * time.Second}
	transport := &kafka.Transport{}
	if *ca != "" {
		pem, err := os.ReadFile(*ca)
		if err != nil {
			return fmt.Errorf("-ca: %w", err)
		}
		roots := x509.NewCertPool()
		if !roots.AppendCertsFromPEM(pem) {
			return fmt.Errorf("-ca %s: no PEM certificate", *ca)
		}
		dialer.TLS = &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}
		transport.TLS = dialer.TLS
	}
	if *user != "" {
		pw, err := os.ReadFile(*passwordFile)
		if err != nil {
			return fmt.Errorf("-sasl-password-file: %w", err)
		}
		mech, err := scram.Mechanism(scram.SHA512, *user, strings.TrimSpace(string(pw)))
		if err != nil {
			return err
		}
		dialer.SASLMechanism, transport.SASL = mech, mech
	}
	defer transport.CloseIdleConnections()

	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	addrs := splitList(*brokers)
	names := splitList(*topics)
	err := retry(ctx, func(ctx context.Context) error {
		return kafkaadmin.CreateTopics(ctx, dialer, addrs, *partitions, names...)
	})
	if err != nil {
		return err
	}
	fmt.Printf("kafka-setup: topics %s (%d partitions) on %s\n", strings.Join(names, ","), *partitions, *brokers)
	if *grant == "" {
		return nil
	}
	var entries []kafka.ACLEntry
	for _, g := range kafkaadmin.Grants(kafkaadmin.NamesOf(config.DefaultGroupID, config.DefaultTopics, true)) {
		entries = append(entries, g.Entry("User:"+*grant))
	}
	client := &kafka.Client{Addr: kafka.TCP(addrs...), Transport: transport, Timeout: 10 * time.Second}
	err = retry(ctx, func(ctx context.Context) error {
		resp, err := client.CreateACLs(ctx, &kafka.CreateACLsRequest{ACLs: entries})
		if err != nil {
			return err
		}
		for _, e := range resp.Errors {
			if e != nil {
				return e
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("grant %s capper's ACLs: %w", *grant, err)
	}
	fmt.Printf("kafka-setup: %d ACLs for User:%s\n", len(entries), *grant)
	return nil
}

// retry calls f until it succeeds or ctx ends: a broker that has just
// started may not have elected its controller or loaded its metadata yet.
func retry(ctx context.Context, f func(context.Context) error) error {
	for {
		err := f(ctx)
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(250 * time.Millisecond):
		}
	}
}
