// Package capping decides, per user, whether one more campaign message may be
// sent under a list of frequency caps, and records the sends it allows.
//
// Each user has a sliding log in Redis: a sorted set whose scores are send
// times in milliseconds and whose members are an 8-byte digest of the job id
// followed by the channel. One Lua script (decide.lua) counts the sends inside
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
// the script. Workers' clocks are assumed to be NTP-synchronised: a worker whose
// clock runs ahead records entries in the future, which count in every window
// until real time passes them (conservative: it can only cap more, never less);
// a worker whose clock runs behind sees entries near the window start for a
// little longer. The error is bounded by the skew, which should be far below a
// cap's window (hours to days).
//
// A Limiter sends a batch of decisions as pipelines grouped by the cluster
// master that owns each user (Config.Pipelines groups of users, each split per
// node), all sent concurrently: one round trip per group and node. Jobs of one
// user in one batch are decided in order and see each other. Errors are per
// request (see RequestErrors): a failing node does not fail the decisions of
// users on other nodes. When a node cannot be reached or redirects, the
// Limiter asks the cluster client to reload the slot map at once, so a replica
// promoted after a crash is used from the next attempt on; a node that answers
// NOSCRIPT (a promoted replica or a restarted node) gets the script loaded and
// only its requests are retried.
//
// Redis replicates asynchronously: a master can acknowledge a recorded send
// and crash before its replica has it, and the promoted replica then no longer
// counts that send. Config.MinReplicasAcked closes that gap at a cost in
// latency: each node's pipeline ends with WAIT on the same connection, and a
// decision that recorded (or found) a send is answered only once enough
// replicas acknowledged it; otherwise it fails with ErrNotReplicated and is
// retried.
package capping
