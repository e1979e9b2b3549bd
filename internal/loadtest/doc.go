// Package loadtest generates synthetic campaign blasts for capper and checks
// what capper wrote to its output topics against what was sent and against
// the caps: the engine behind `capper loadgen`, `capper report`, the demo and
// the end-to-end benchmark.
package loadtest
