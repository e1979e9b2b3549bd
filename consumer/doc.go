// Package consumer is capper's Kafka worker: it reads send jobs as a member of
// a consumer group, decides each one and writes it to its topics, and only
// then commits the batch's offsets.
//
// A batch goes through these steps (batch.go): decode, release (a delay
// tier's job not due yet moves on), plan (rules.Plan: exempt, quiet hours,
// the caps and budgets that apply), budget tokens, Redis (one capping call
// per attempt, retried, with fail-open), give back the tokens of jobs not
// forwarded, encode. After each step route (route.go), a pure function,
// gives each job's Outcome (outcome.go) or the step it waits for; wire.go
// writes outcomes as Kafka messages with the headers of package output,
// which reads them back.
//
// Every job ends in exactly one final topic: allowed (allowed, duplicate,
// exempt, unchecked), capped or dead-letter. A held job first waits on the
// delay topics (with an audit record on the held topic) and is decided again
// when it is due.
//
// Delivery is at least once. An offset is committed only after the outputs of
// its batch are acknowledged by the broker (all in-sync replicas), so a crash,
// a rebalance or a failed write leads to redelivery, never to loss. A
// redelivered job is recognised by its job id in the user's log: it is not
// counted again and is forwarded again with the decision "duplicate", so
// consumers of the output topics must tolerate duplicates (key them by job_id).
// A job that must not go (expired, quiet hours under drop, short of a budget
// token with no hold) is checked for a duplicate only, so that a redelivery
// of one that went keeps its one final topic.
package consumer
