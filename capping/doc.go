// Package capping decides, per user, whether one more campaign message may be
// sent under a list of frequency caps, and records the sends it allows.
//
// Each user has a sliding log in Redis: one string of packed entries, each a
// send time in milliseconds and a member, an 8-byte digest of the job id
// followed by digests of the channel, campaign and tags (see Member and
// ReadLog; logs an older capper kept as sorted sets are read as such and
// rewritten by the next decision that records). One Lua script (decide.lua) counts the sends inside
// every cap's window, allows the send only if every cap passes, and records it
// in the same atomic step, so any number of workers can decide for the same
// user at once without over-sending.
//
// Because the member is derived from the job id, a job that is delivered again
// (a Kafka redelivery) is recognised for as long as its entry is in the log (the
// longest window): it is not counted twice and gets its original "allowed"
// answer back, marked Duplicate. Two different jobs sent in the same
// millisecond are two entries.
//
// Time comes from the worker (Config.Clock), never from Redis, and is passed to
// the script (as in Grab's design), so replicas must agree on the time. A
// replica whose clock runs ahead by d evaluates windows that start d too late:
// it does not count sends recorded in the first d of the true window, so it
// caps less. A replica whose clock runs behind by d records sends d too early,
// so every other replica stops counting them d too soon: they cap less. With
// replicas skewed by up to d, a user can receive more than a cap allows by the
// sends in a slice of width d at the window's edge. Eviction would make it
// worse (a replica ahead by d deletes entries that others still count), so
// entries are kept Config.ClockMargin longer than the longest window. The
// daemon measures each worker's clock against Redis and stops deciding beyond
// max_clock_skew (see internal/daemon and package skew).
//
// A tally cap (Cap.Tally: a lifetime cap, or a long window) is counted from
// an item of the log that keeps its count, not from the log's sends: see
// tally.go.
//
// A send to a user who has no log passes every cap of 1 or more: the Limiter
// records it with one SET NX of the log the script would write, which writes
// nothing if the user has a log after all (the script then decides it); see
// newlog.go and Config.ScriptOnly.
//
// A Limiter sends a batch of decisions as pipelines grouped by the cluster
// master that owns each user (Config.Pipelines groups of users, each split per
// node), all sent concurrently: one round trip per group and node. Jobs of one
// user in one batch are decided in order and see each other. Errors are per
// request (see RequestErrors): a failing node does not fail the decisions of
// users on other nodes. When a node cannot be reached or redirects, the
// Limiter asks the cluster client to reload the slot map at once, so a replica
// promoted after a crash is used from the next attempt on; a node that answers
// "Function not found" (a node restarted without persistence, a FUNCTION
// FLUSH) gets decide.lua's function library loaded and only its requests are
// retried.
//
// Redis replicates asynchronously: a master can acknowledge a recorded send
// and crash before its replica has it, and the promoted replica then no longer
// counts that send. Config.MinReplicasAcked closes that gap at a cost in
// latency: each node's pipeline ends with WAIT on the same connection, and a
// decision that recorded (or found) a send is answered only once enough
// replicas acknowledged it; otherwise it fails with ErrNotReplicated and is
// retried.
package capping
