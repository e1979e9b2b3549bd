# capper — make targets. Every target that needs servers starts the local stack itself.
.PHONY: demo test test-contended stack-up stack-down stack-status build vet bench-capping bench-segments bench-e2e bench-cost bench-blast bench-hold bench-budget bench-budget-cost bench-priority bench-prefs bench-workspaces bench-lifetime

GO ?= go

## demo: the real worker against the local stack: 200,000 jobs for 50,000 users, then a verifying report
demo:
	scripts/demo.sh

## test: the whole test suite against the local stack (what CI runs)
test:
	scripts/test.sh

## test-contended: the whole test suite with one busy process per core (a busy machine)
test-contended:
	scripts/test.sh --contended

## build: the release binary into bin/capper (static, reproducible, version stamped: scripts/build.sh)
build:
	scripts/build.sh bin/capper $(VERSION)

stack-up:
	scripts/stack.sh up
stack-down:
	scripts/stack.sh down
stack-status:
	scripts/stack.sh status

vet:
	$(GO) vet ./...

## bench-capping: capper's decisions/s at batch 512 vs the FCALL ceiling of the same script (capper-devstack calls; medians, ratio)
bench-capping:
	scripts/bench-capping.sh

## bench-lifetime: what lifetime caps and collapse keys cost: decisions/s and jobs/s without them against the commits before them, with one on every job against none, and the tally's Redis bytes per scope (medians of 3 alternated rounds)
bench-lifetime:
	scripts/bench-lifetime.sh

## bench-segments: snapshot heap, load time and lookup cost for 270 million users in 4 segments (medians)
bench-segments:
	scripts/bench-segments.sh

## bench-e2e: 1,000,000 jobs end to end with the near cache on and off vs a pass-through baseline, 3 alternated rounds: jobs/s and CPU per job of Redis, worker and broker, medians and ratios
bench-e2e:
	scripts/bench-e2e.sh

## bench-cost: what a job costs Redis, the worker and the broker (bench-e2e) on the stream workload and on a backlog (the blast produced before the worker starts), the backlog again with Redis on a core of its own (as on its own hosts), and what one call of capper's script, the seed's and a bare one costs Redis (scripts/bench-calls.sh)
bench-cost:
	scripts/bench-e2e.sh
	BENCH_WORKLOAD=backlog BENCH_CALLS=0 scripts/bench-e2e.sh
	BENCH_WORKLOAD=backlog BENCH_CALLS=0 BENCH_REDIS_CORE=1 scripts/bench-e2e.sh

## bench-blast: the 10,000,000-job blast over 2,000,000 users: drain time, jobs/s, worker CPU and RSS, Redis memory, the report's verdict
bench-blast:
	scripts/bench-blast.sh

## bench-hold: the throughput cost of holding capped sends: the same blast under drop and under hold, alternated, medians and the ratio
bench-hold:
	scripts/bench-hold.sh

## bench-budget: does a budget deliver its limit? 50 SMS/s over windows of 1, 2 and 5 s under 3x the demand for 30 s, 1 and 3 replicas, a SIGKILL and (1 s) every core busy; then bursts of 10 windows' limit at once, windows of 1, 2 and 5 s, 1 and 3 replicas: per-window delivery and hold records per job (medians of 3)
bench-budget:
	scripts/bench-budget.sh delivery
	scripts/bench-budget.sh burst

## bench-budget-cost: the cost of a global budget that never binds, end to end, side by side with none, and its Redis calls per 1,000 jobs
bench-budget-cost:
	scripts/bench-budget.sh cost

## bench-priority: what priority costs per decision: unused, reserved, arbitrated, every send competing (medians of 3)
bench-priority:
	scripts/bench-modes.sh Priority unused reserved arbitrated competing

## bench-prefs: decisions/s with users' preferences not read, read but absent, present for every user (medians of 3)
bench-prefs:
	scripts/bench-modes.sh Preferences off none every_user

## bench-workspaces: one workspace against 100 identical ones, the same blast: jobs/s and the worker's peak memory per workspace (medians of 3, alternated)
bench-workspaces:
	scripts/bench-workspaces.sh
