// Package output is capper's output contract: the topics' headers, the
// decisions they carry, and the reader and parser of what capper writes.
//
// Every job capper consumes ends in exactly one final topic (allowed, capped
// or dead-letter), with its original key, value and headers and capper's
// headers (Header*). A held job first passes through the delay topics, with
// an audit record on the held topic (decision "held", not final). Delivery
// is at least once: a job may reach its final topic more than once after a
// crash or a rebalance, always with the same decision (a redelivered allowed
// job says "duplicate"), so key what you consume by the job's job_id.
//
// Parse reads capper's headers of one message into an Output; Read reads
// whole topics from their beginning and hands each message to a function.
// capper report, the tests and any downstream service written in Go use
// them, so a header renamed in one place cannot break a reader silently.
//
// docs/contract.md describes every decision and header for readers in any
// language.
package output
