package capping_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/internal/testenv"
)

// TestSpacesAreSeparateUsers: the same user id in two key spaces (two
// workspaces) is two users: a cap filled in one leaves the other's slots,
// each has its own log under its own prefix, and the near cache that
// answers one user's capped sends never answers the other's, in a batch
// that mixes both.
func TestSpacesAreSeparateUsers(t *testing.T) {
	e := newEnv(t, func(c *capping.Config) { c.NearCache = 1000 })
	ctx := context.Background()
	prefix := testenv.Unique("ws")
	acme, err := e.lim.AddSpace(prefix + ":acme")
	if err != nil {
		t.Fatal(err)
	}
	globex, err := e.lim.AddSpace(prefix + ":globex")
	if err != nil {
		t.Fatal(err)
	}
	if again, err := e.lim.AddSpace(prefix + ":acme"); err != nil || again != acme {
		t.Fatalf("adding acme's prefix again: space %d, %v; want %d", again, err, acme)
	}
	if acme == 0 || globex == acme {
		t.Fatalf("spaces %d and %d: want two new ones besides 0", acme, globex)
	}
	if k := e.lim.Key(globex, 42); k != prefix+":globex:{42}" {
		t.Fatalf("globex's key of user 42 is %q", k)
	}
	in := func(s capping.Space, r capping.Request) capping.Request { r.Space = s; return r }
	// acme's user 42 uses its 3 daily slots; its 4th send is capped (and
	// the copy of its log is cached).
	for i := range 4 {
		d := e.decide(t, in(acme, job(42, "email", daily3)))[0]
		if d.Allowed != (i < 3) {
			t.Fatalf("acme send %d: allowed %v", i+1, d.Allowed)
		}
		e.clock.Add(time.Second)
	}
	before := e.lim.Stats().CacheHits
	// One batch: acme's user 42 (capped, from the cache), globex's user 42
	// (a new user: allowed), and space 0's user 42 (allowed).
	ds := e.decide(t, in(acme, job(42, "email", daily3)), in(globex, job(42, "email", daily3)), job(42, "email", daily3))
	if ds[0].Allowed || ds[0].Cap != "daily" {
		t.Fatalf("acme's user 42: %+v, want capped by daily", ds[0])
	}
	if !ds[1].Allowed || !ds[2].Allowed {
		t.Fatalf("globex's user 42 allowed %v, space 0's %v: want both allowed (other users)", ds[1].Allowed, ds[2].Allowed)
	}
	if hits := e.lim.Stats().CacheHits - before; hits != 1 {
		t.Fatalf("%d near cache hits in the mixed batch, want 1 (acme's capped user)", hits)
	}
	for s, want := range map[capping.Space]int{acme: 3, globex: 1, 0: 1} {
		if n := testenv.LogLen(t, e.rdb, e.lim.Key(s, 42)); n != want {
			t.Fatalf("space %d: user 42's log has %d entries, want %d", s, n, want)
		}
	}
	// globex's user 42 fills its own cap, unaffected by acme's.
	for i := range 3 {
		d := e.decide(t, in(globex, job(42, "email", daily3)))[0]
		if d.Allowed != (i < 2) {
			t.Fatalf("globex send %d: allowed %v", i+2, d.Allowed)
		}
	}
	// A preference is the space's user's alone.
	if err := e.lim.SetPreference(ctx, globex, 42, capping.Preference{Channel: "push", OptOut: true}, false); err != nil {
		t.Fatal(err)
	}
	for s, want := range map[capping.Space]int{acme: 0, globex: 1} {
		ps, err := e.lim.Preferences(ctx, s, 42)
		if err != nil || len(ps) != want {
			t.Fatalf("space %d: user 42 has %d preferences (%v), want %d", s, len(ps), err, want)
		}
	}
}

// TestUnknownSpaceIsInvalid: a request of a space this Limiter was never
// given fails alone, as an invalid request; the others are decided.
func TestUnknownSpaceIsInvalid(t *testing.T) {
	e := newEnv(t)
	bad := job(1, "email", daily3)
	bad.Space = 9
	ds, err := e.lim.Decide(context.Background(), []capping.Request{bad, job(2, "email", daily3)})
	var re capping.RequestErrors
	if !errors.As(err, &re) || !errors.Is(re[0], capping.ErrInvalidRequest) || re[1] != nil {
		t.Fatalf("err %v: want request 0 invalid, request 1 decided", err)
	}
	if !ds[1].Allowed {
		t.Fatalf("request 1: %+v, want allowed", ds[1])
	}
	if _, err := e.lim.AddSpace("bad{prefix}"); err == nil {
		t.Fatal("a prefix with braces was accepted")
	}
}
