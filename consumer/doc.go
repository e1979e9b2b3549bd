// Package consumer is capper's Kafka worker: it reads send jobs as a member of
// a consumer group, resolves each user's segment, decides the whole batch with
// one capping call, writes every job to exactly one output topic (allowed,
// capped or dead-letter), and only then commits the batch's offsets.
//
// Delivery is at least once. An offset is committed only after the outputs of
// its batch are acknowledged by the broker (all in-sync replicas), so a crash,
// a rebalance or a failed write leads to redelivery, never to loss. A
// redelivered job is recognised by its job id in the user's log: it is not
// counted again and is forwarded again with the decision "duplicate", so
// consumers of the output topics must tolerate duplicates (key them by job_id).
package consumer
