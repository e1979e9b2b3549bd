package capping

import (
	"slices"
	"time"
)

// EvalOf returns call (ScriptCall's) as the fallback sends it: EVAL with the
// script's body instead of FCALL of the function.
func EvalOf(call []any) []any {
	c := slices.Clone(call)
	c[0], c[1] = evalHead[0], evalHead[1]
	return c
}

// NextEntry is nextEntry: the entry or tally item (score 0) at log[p:].
func NextEntry(log string, p int) (member string, score int64, next int, ok bool) {
	return nextEntry(log, p)
}

// CachedCall is ScriptCall as a Limiter with a near cache sends it: asking for
// a copy of each log of at most cacheMaxLog entries and tally items.
func CachedCall(keys []string, reqs []Request, now time.Time) ([]any, error) {
	return callOfScript(keys, reqs, nil, now, cacheMaxLog)
}
