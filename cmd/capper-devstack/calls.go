package main

// capper-devstack calls: the load scripts/bench-calls.sh and bench-capping.sh measure, a script called
// many times on the local Redis Cluster with the arguments of its kind.

import (
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/capper-dev/capper/capping"
)

// benchCaps are the caps of every decide call: a daily and a weekly cap of every send, with limits no
// send reaches, so that each call takes the write path (read the log, count, record, set the TTL).
var benchCaps = []capping.Cap{
	{Name: "daily", Window: capping.Daily, Limit: 1 << 30},
	{Name: "weekly", Window: capping.Weekly, Limit: 1 << 30},
}

// calls sends -n calls of the script -sha (EVALSHA), or of capper's function (FCALL of decide.lua's
// library, as capper calls it) when -sha is empty and -args is decide, batch or copy, over -users random
// users, from -clients connections that each send pipelines of -pipeline calls (as redis-benchmark -c
// and -P), and prints the decisions per second (calls per second, times -batch with -args batch). -load
// loads capper's function library on every master and returns. The arguments are those of -args:
//
//	decide  capper's own call of capping/decide.lua (capping.ScriptCall) with benchCaps; a script
//	        measured against decide.lua (a bare call, its floor, a variant, decide.lua itself as a
//	        script) gets the same
//	seed    the seed's sliding log (scripts/lua/seed.lua): the member, the eviction time, then the
//	        start and limit of the same two windows
//	seedttl the same, then a TTL of the longest window, which seed.lua sets with a PEXPIRE
//	batch   capper's call of capping/decide.lua for -batch users at once (as Decide sends a node's
//	        requests)
//	copy    capper's call of decide.lua for a send its near cache decided allowed from its whole copy
//	        of the user's log (mode 4: one GET, the compare, one APPEND), -batch users per call, each
//	        call's users new (users -n); -setup writes their logs first (a header and one send an hour
//	        before -at), which bench-calls.sh runs outside what it measures
//
// Every key is PREFIX:{tag}:USER (one slot: a batch's keys must be on one node). The calls are made
// before the first is sent, so what the run costs Redis is the calls alone. An error reply stops it: an
// erroring script is cheap and would measure nothing.
func calls(args []string) error {
	fs := flag.NewFlagSet("calls", flag.ExitOnError)
	addrs := fs.String("addrs", "127.0.0.1:7000", "comma-separated Redis Cluster nodes")
	sha := fs.String("sha", "", "SHA1 of the script, loaded on every node (empty: capper's function, with -args decide, batch or copy)")
	load := fs.Bool("load", false, "load capper's function library on every master, and call nothing")
	kind := fs.String("args", "decide", "the arguments: decide, seed, seedttl, batch or copy")
	setup := fs.Bool("setup", false, "with -args copy: write the users' logs (the copies) instead of calling")
	at := fs.Int64("at", 0, "with -args copy: the calls' clock in ms (0: now); -setup and the calls must agree")
	n := fs.Int("n", 300000, "calls to make (with -args batch: decisions; calls are n / batch)")
	users := fs.Int("users", 250000, "random users the calls go to")
	clients := fs.Int("clients", 32, "connections, each sending one pipeline at a time")
	pipeline := fs.Int("pipeline", 16, "calls per pipeline")
	batch := fs.Int("batch", 16, "users per call with -args batch")
	prefix := fs.String("prefix", "rbcost", "key prefix")
	_ = fs.Parse(args)
	if *load {
		rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: splitList(*addrs)})
		defer rdb.Close()
		_, err := capping.New(context.Background(), rdb, capping.Config{KeyPrefix: *prefix})
		return err
	}
	if (*sha == "" && (*kind == "seed" || *kind == "seedttl")) || *n < 1 || *users < 1 || *clients < 1 || *pipeline < 1 || *batch < 1 {
		return errors.New("calls: -sha is required with -args seed and seedttl; -n, -users, -clients, -pipeline and -batch must be positive")
	}
	now := time.Now()
	if *at > 0 {
		now = time.UnixMilli(*at)
	}
	rng := rand.New(rand.NewPCG(uint64(now.UnixNano()), 27))
	key := func(u int) string { return *prefix + ":{tag}:" + strconv.Itoa(u) }
	request := func(u int) capping.Request {
		return capping.Request{UserID: uint32(u), JobID: "m" + strconv.Itoa(u) + "-" + strconv.FormatUint(rng.Uint64(), 36),
			Channel: "email", Caps: benchCaps}
	}
	ms := now.UnixMilli()
	total := *n
	if *kind == "batch" || *kind == "copy" {
		total = *n / *batch
	}
	// copyLog is user u's log as -setup writes it and a copy call expects it: its header (the TTL's end, a
	// day beyond a week), then one send an hour before now.
	copyLog := func(u int) string {
		m := capping.Member("prev"+strconv.Itoa(u), "email", "", nil)
		b := binary.BigEndian.AppendUint64(nil, uint64(ms+8*capping.Daily.Milliseconds()))
		b = binary.BigEndian.AppendUint64(b, uint64(ms-time.Hour.Milliseconds()))
		b = binary.BigEndian.AppendUint16(b, uint16(len(m)))
		return string(append(b, m...))
	}
	// script makes a call of decide.lua's an EVALSHA of -sha, when given.
	script := func(c []any) []any {
		if *sha != "" {
			c[0], c[1] = "evalsha", *sha
		}
		return c
	}
	cmds := make([][]any, total)
	for i := range cmds {
		u := rng.IntN(*users)
		switch *kind {
		case "copy":
			keys, reqs, logs := make([]string, *batch), make([]capping.Request, *batch), make([]string, *batch)
			for j := range reqs {
				u = i**batch + j
				keys[j], reqs[j], logs[j] = key(u), request(u), copyLog(u)
			}
			if *setup {
				for j := range keys {
					cmds = append(cmds, []any{"set", keys[j], logs[j], "px", 9 * capping.Daily.Milliseconds()})
				}
				continue
			}
			c, err := capping.CopyCall(keys, reqs, logs, now)
			if err != nil {
				return err
			}
			cmds[i] = script(c)
		case "decide":
			c, err := capping.ScriptCall([]string{key(u)}, []capping.Request{request(u)}, now)
			if err != nil {
				return err
			}
			cmds[i] = script(c)
		case "seed", "seedttl":
			cmds[i] = []any{"evalsha", *sha, 1, key(u), ms, "m" + strconv.Itoa(u), ms - capping.Weekly.Milliseconds(),
				ms - capping.Daily.Milliseconds() + 1, 1 << 30, ms - capping.Weekly.Milliseconds() + 1, 1 << 30}
			if *kind == "seedttl" { // the TTL a deployment would give its keys: the longest window
				cmds[i] = append(cmds[i], capping.Weekly.Milliseconds())
			}
		case "batch":
			keys, reqs := make([]string, *batch), make([]capping.Request, *batch)
			for j := range reqs {
				keys[j], reqs[j] = key(u), request(u)
				u = rng.IntN(*users)
			}
			c, err := capping.ScriptCall(keys, reqs, now)
			if err != nil {
				return err
			}
			cmds[i] = script(c)
		default:
			return fmt.Errorf("calls: -args %q: want decide, seed, seedttl, batch or copy", *kind)
		}
	}
	if *setup {
		cmds, total = cmds[total:], len(cmds)-total // the SETs, not the calls
	}
	start := time.Now()
	if err := pipelined(splitList(*addrs), *clients, *pipeline, cmds[:total], *kind == "copy" && !*setup); err != nil {
		return err
	}
	per := 1
	if (*kind == "batch" || *kind == "copy") && !*setup {
		per = *batch
	}
	fmt.Printf("%.0f\n", float64(total*per)/time.Since(start).Seconds())
	return nil
}

// pipelined sends cmds from clients connections, each a pipeline of
// pipeline calls at a time; with checkCopy, every reply must be '=' per user
// (each send appended to its copy's log: the path measured).
func pipelined(addrs []string, clients, pipeline int, cmds [][]any, checkCopy bool) error {
	total := len(cmds)
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs, PoolSize: clients})
	defer rdb.Close()
	ctx := context.Background()
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	for range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				from := int(next.Add(int64(pipeline))) - pipeline
				if from >= total {
					return
				}
				p := rdb.Pipeline()
				for _, c := range cmds[from:min(from+pipeline, total)] {
					p.Do(ctx, c...)
				}
				res, err := p.Exec(ctx)
				if err != nil {
					errs <- fmt.Errorf("calls: %w", err)
					return
				}
				if checkCopy { // each send appended to its copy's log: the path measured
					for _, c := range res {
						if v, _ := c.(*redis.Cmd).Slice(); len(v) == 0 || v[0] != "=" {
							errs <- fmt.Errorf("calls: a copy call answered %q, want '=' per user (the log is the copy)", v)
							return
						}
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}
