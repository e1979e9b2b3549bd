package capping

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"unsafe"

	"github.com/redis/go-redis/v9"
)

// LoadFunctions loads decide.lua's function library on every master. A
// master's replicas get it by replication and keep it, so a replica promoted
// by failover has it (a script cache is neither replicated nor kept). Decide
// loads it by itself on a node that answers "Function not found".
func (l *Limiter) LoadFunctions(ctx context.Context) error {
	if l.cluster != nil {
		return l.cluster.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
			return loadFunction(ctx, c, c.Options().Addr)
		})
	}
	return loadFunction(ctx, l.client, "redis")
}

func loadFunction(ctx context.Context, n node, name string) error {
	lib, err := n.FunctionLoadReplace(ctx, decideLibrary).Result()
	if err != nil {
		return fmt.Errorf("capping: load function library %s on %s: %w", decideLibraryName, name, err)
	}
	if lib != decideLibraryName {
		return fmt.Errorf("capping: load function library on %s: loaded %s, want %s", name, lib, decideLibraryName)
	}
	return nil
}

// unloaded reports whether err is a node's answer that it has not the
// function library.
func unloaded(err error) bool { return redis.HasErrorPrefix(err, "Function not found") }

// batch is one attempt at deciding a set of requests.
type batch struct {
	l        *Limiter
	reqs     []Request
	args     []reqArgs // by request
	maxLog   int       // maxlog of the packed values: the longest log the script returns for the cache
	record   bool
	results  []result // by request
	nodes    []node   // by request: where it was sent; nil when it could not be routed
	alone    []bool   // by request: sent in a call of its own (a call with it was redirected)
	calls    []call   // this attempt's
	sets     []set    // this attempt's SET NX of new logs
	routeErr error
	fresh    []bool                   // by request: sent as a new log (SET NX, see newlog.go) this attempt; nil: none
	eval     bool                     // send EVAL with the script's body instead of FCALL
	waits    map[node][]*redis.IntCmd // by node: the WAITs of its pipelines
	sc       *scratch                 // the working arrays above, reused by the next batch
}

type pipeKey struct {
	n node
	p int
}

// perCall is the most requests one call of decide.lua carries. A call's own
// cost (~1.7 us of a master's CPU: parsing, the Lua call, the reply) is paid
// once for them, and the node runs the call for a few hundred microseconds at
// most (a request costs it ~10 us).
const perCall = 32

// call is one call of decide.lua and the requests it carries, in order.
type call struct {
	cmd  *redis.Cmd
	reqs []int
}

// set is the SET NX of request i's new log.
type set struct {
	cmd *redis.StatusCmd
	i   int
}

// result is what a request's call answered for it.
type result struct {
	v      any
	err    error
	shared bool // the call carried other requests
}

// send queues pending requests on one pipeline per (user group, master), in
// calls of up to perCall requests (one each for those marked alone), and
// executes them concurrently; results and errors land in b.results.
func (b *batch) send(ctx context.Context, pending []int) {
	pipes := b.queue(ctx, pending)
	b.l.calls.Add(uint64(len(b.calls)))
	var wg sync.WaitGroup
	for k, o := range pipes {
		if b.l.cfg.MinReplicasAcked > 0 && b.record {
			w := redis.NewIntCmd(ctx, "wait", b.l.cfg.MinReplicasAcked, b.l.cfg.ReplicaTimeout.Milliseconds())
			_ = o.p.Process(ctx, w)
			b.waits[k.n] = append(b.waits[k.n], w)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _ = o.p.Exec(ctx) // errors are read per call
		}()
	}
	wg.Wait()
	b.read()
}

// pipe is one pipeline of an attempt, and the requests of its next call.
type pipe struct {
	p    redis.Pipeliner
	reqs []int
}

// queue routes each pending request to its master and queues it: a new log's
// SET NX, or a request packed into a call of decide.lua (see flush).
func (b *batch) queue(ctx context.Context, pending []int) map[pipeKey]*pipe {
	l := b.l
	n := l.cfg.Pipelines
	if len(pending) < 64 {
		n = 1
	}
	pipes := map[pipeKey]*pipe{}
	b.waits = map[node][]*redis.IntCmd{}
	b.calls = b.calls[:0]
	b.sets = b.sets[:0]
	packed := grow(&b.sc.packed, b.packedBytes(pending)) // every request's packed values
	keys := grow(&b.sc.keys, l.keysBytes(b.reqs, pending))[:0]
	var setArgs []any // the new logs' SET commands' arguments, a few arrays a batch
	for _, i := range pending {
		r := &b.reqs[i]
		a := &b.args[i]
		start := len(keys)
		keys = l.appendKey(keys, r.Space, r.UserID)
		a.key = unsafe.String(&keys[start], len(keys)-start) // keys has its room: never moved (see keysBytes)
		nd, err := l.route(ctx, a.key)
		if err != nil {
			b.nodes[i], b.routeErr = nil, err
			continue
		}
		b.nodes[i] = nd
		k := pipeKey{nd, int(r.UserID % uint32(n))}
		o := pipes[k]
		if o == nil {
			o = &pipe{p: nd.Pipeline()}
			pipes[k] = o
		}
		// A new log, the bytes the script would write: by SET NX PX, or (a send
		// that reads preferences) by the script's modeNewLog, fresh.
		var fresh string
		if b.fresh != nil && b.fresh[i] {
			m := newLogLen(a)
			fresh, a.ttl = newLog(packed[:0:m], a)
			packed = packed[m:]
			if !r.Preferences {
				a.packed = fresh
				if cap(setArgs)-len(setArgs) < 6 {
					setArgs = make([]any, 0, 6*64)
				}
				n := len(setArgs)
				setArgs = append(setArgs, "set", &a.key, &a.packed, "nx", "px", &a.ttl)
				cmd := redis.NewStatusCmd(ctx, setArgs[n:len(setArgs):len(setArgs)]...)
				_ = o.p.Process(ctx, cmd)
				b.sets = append(b.sets, set{cmd, i})
				continue
			}
		}
		record, maxLog := b.record, b.maxLog
		if r.DuplicateOnly {
			record, maxLog = false, 0
		}
		m := packedLen(a)
		pack(packed[:0:m], r, a, record, maxLog, fresh)
		packed = packed[m:]
		if b.alone[i] {
			b.flush(ctx, o)
		}
		if o.reqs == nil {
			o.reqs = make([]int, 0, perCall)
		}
		o.reqs = append(o.reqs, i)
		if b.alone[i] || len(o.reqs) == perCall {
			b.flush(ctx, o)
		}
	}
	for _, o := range pipes {
		b.flush(ctx, o)
	}
	return pipes
}

// keysBytes is the room the keys of the pending requests take (appendKey).
func (l *Limiter) keysBytes(reqs []Request, pending []int) int {
	n := 0
	for _, i := range pending {
		n += len(l.prefix(reqs[i].Space)) + len(":{}") + 10 // a uint32's digits at most
	}
	return n
}

// packedBytes is the size of the pending requests' packed values and new logs.
func (b *batch) packedBytes(pending []int) int {
	bytes := 0
	for _, i := range pending {
		fresh := b.fresh != nil && b.fresh[i]
		if fresh {
			bytes += newLogLen(&b.args[i])
		}
		if !fresh || b.reqs[i].Preferences {
			bytes += packedLen(&b.args[i])
		}
	}
	return bytes
}

// flush queues the call of o's requests on its pipeline.
func (b *batch) flush(ctx context.Context, o *pipe) {
	if len(o.reqs) == 0 {
		return
	}
	c := call{cmd: redis.NewCmd(ctx, callArgs(b.eval, b.reqs, b.args, o.reqs)...), reqs: o.reqs}
	_ = o.p.Process(ctx, c.cmd) // queued; the result is read per call
	b.calls = append(b.calls, c)
	o.reqs = nil
}

// read puts each request's answer, or its call's error, in b.results.
func (b *batch) read() {
	for _, st := range b.sets {
		b.results[st.i] = result{err: st.cmd.Err()} // its "OK" is not read: a new log's decision is known (see round.decided)
	}
	for _, c := range b.calls {
		v, err := c.cmd.Result()
		var replies []any
		if err == nil {
			var ok bool
			if replies, ok = v.([]any); !ok || len(replies) != len(c.reqs) {
				err = fmt.Errorf("unexpected script reply %#v: want %d replies", v, len(c.reqs))
			}
		}
		for j, i := range c.reqs {
			switch {
			case err != nil:
				b.results[i] = result{err: err, shared: len(c.reqs) > 1}
			default:
				if e, ok := replies[j].(error); ok { // this request's own failure
					b.results[i] = result{err: e, shared: len(c.reqs) > 1}
				} else {
					b.results[i] = result{v: replies[j]}
				}
			}
		}
	}
}

// redirected reports whether err is a node's refusal of a call, or of a
// request in it, for a slot it does not serve (now): the requests of a call
// with several users' keys are then sent again one per call (their own key
// declared, so that the node redirects the call), and one moving slot holds
// up only its own users.
func redirected(err error) bool {
	for _, p := range []string{"MOVED", "ASK", "CROSSSLOT", "TRYAGAIN"} {
		if redis.HasErrorPrefix(err, p) {
			return true
		}
	}
	return strings.Contains(err.Error(), "non local key")
}

// replicated reports whether every WAIT sent to n this attempt reached
// MinReplicasAcked (always true when durability is off).
func (b *batch) replicated(n node) bool {
	for _, w := range b.waits[n] {
		if acked, err := w.Result(); err != nil || acked < int64(b.l.cfg.MinReplicasAcked) {
			return false
		}
	}
	return true
}

func (b *batch) waitErr(n node) error {
	for _, w := range b.waits[n] {
		acked, err := w.Result()
		if err != nil {
			return fmt.Errorf("%w: WAIT on %s: %w", ErrNotReplicated, nodeName(n), err)
		}
		if acked < int64(b.l.cfg.MinReplicasAcked) {
			return fmt.Errorf("%w: %d of %d replicas of %s acknowledged within %v", ErrNotReplicated, acked, b.l.cfg.MinReplicasAcked, nodeName(n), b.l.cfg.ReplicaTimeout)
		}
	}
	return ErrNotReplicated
}

// route returns the node that owns key: its master in a cluster, the client itself otherwise.
func (l *Limiter) route(ctx context.Context, key string) (node, error) {
	if l.cluster == nil {
		return l.client, nil
	}
	c, err := l.cluster.MasterForKey(ctx, key)
	if err != nil {
		return nil, fmt.Errorf("no master known for %s: %w", key, err)
	}
	return c, nil
}

// reloadTopology asks the cluster client to reload the slot map now rather
// than at its next periodic reload: after a crash the promoted replica is
// found as soon as the cluster has promoted it. go-redis runs one reload at a
// time with a 200ms cool-down, so calling this on every failed attempt is cheap.
func (l *Limiter) reloadTopology(ctx context.Context) {
	if l.cluster == nil {
		return
	}
	l.cluster.ReloadState(ctx)
}

// topologyChanged reports whether err suggests the slot map is stale: the
// node could not be reached (crashed, frozen, restarting), or it redirected
// or refused because it is no longer (or not yet) the slot's master.
func topologyChanged(err error) bool {
	var rerr redis.Error
	if !errors.As(err, &rerr) {
		return !errors.Is(err, ErrNotReplicated) // network errors, timeouts, closed pools
	}
	for _, p := range []string{"MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN", "READONLY", "LOADING", "MASTERDOWN"} {
		if redis.HasErrorPrefix(err, p) {
			return true
		}
	}
	return false
}

func nodeName(n node) string {
	if c, ok := n.(*redis.Client); ok {
		return c.Options().Addr
	}
	return "redis"
}
