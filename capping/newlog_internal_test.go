package capping

import "testing"

// TestSeenUsersForgetsTwoGenerationsLater: a user added stays seen through
// one switch of generations and is forgotten at the second; users never
// added are reported unseen but for collisions of their bits, which stay
// rare below the fill that switches.
func TestSeenUsersForgetsTwoGenerationsLater(t *testing.T) {
	s := newSeenUsers()
	const early = 4_000_000_000
	s.add(early)
	if !s.has(early) {
		t.Fatal("a user just added is not seen")
	}
	false1 := 0
	for u := uint64(1); u <= 100_000; u++ {
		if s.has(u) {
			false1++
		}
	}
	if false1 > 0 {
		t.Fatalf("%d of 100,000 users never added seen beside one added", false1)
	}
	fill := func() { // add users until the current generation switches
		g := s.cur.Load()
		for u := uint64(1); s.cur.Load() == g; u++ {
			s.add(u*7919 + uint64(g)*1_000_003)
		}
	}
	fill()
	if !s.has(early) {
		t.Fatal("forgotten at the first switch: want it kept one generation more")
	}
	fill()
	if s.has(early) {
		t.Fatal("still seen after two switches")
	}
	if n := s.set.Load(); n != 0 {
		t.Fatalf("%d bits counted in a generation just cleared", n)
	}
}
