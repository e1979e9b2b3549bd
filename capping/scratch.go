package capping

// capSlab holds the caps Decide sends when some of a request's do not apply,
// reused from batch to batch (a Decision points at none of them).
var capSlab = make(spares[[]Cap], 4)

// spares keeps a few values for reuse from batch to batch: one per
// concurrent Decide in a daemon (its worker and its delay tiers'). Unlike a
// sync.Pool, the garbage collector does not empty it: the worker collects
// several times a second, and a pool emptied each time left most batches to
// allocate their arrays again (128 MB in 12 s of a blast, as much as 4% of
// what the worker allocates).
type spares[T any] chan *T

func (s spares[T]) get() *T {
	select {
	case v := <-s:
		return v
	default:
		return new(T)
	}
}

func (s spares[T]) put(v *T) {
	select {
	case s <- v:
	default: // enough are kept
	}
}

// scratch holds a batch's working arrays, reused from batch to batch: a
// batch of 2,000 jobs needs about 1 MB of them, which allocated afresh each
// time was a third of the worker's allocations (and of its GC). Nothing the
// caller keeps points into them: a Decision's Counts are allocated apart.
type scratch struct {
	args    []reqArgs
	ints    []int64
	orig    []int
	results []result
	nodes   []node
	alone   []bool
	pending []int
	packed  []byte           // the requests' packed values (see pack)
	keys    []byte           // the requests' keys (see batch.queue)
	sent    map[uint64]bool  // by Request.who
	users   map[uint64]int32 // requests per user sent to Redis (see Limiter.markNewLogs)
	fresh   []bool
	asked   []int // the near cache's lookups (see run, nearCache.decideAll)
	hit     []bool
	order   []int
	slots   []int32
	hints   []int32   // by request: its copy's slot plus one at the lookup (see nearCache.install)
	log     []logItem // a log read by nearCache.installWith
}

// items returns sc's buffer of a log's items (capacity cacheMaxLog).
func (sc *scratch) items() []logItem {
	if sc.log == nil {
		sc.log = make([]logItem, 0, cacheMaxLog)
	}
	return sc.log[:0]
}

var scratchPool = make(spares[scratch], 4)

// release clears what points at the batch's requests and replies, and puts sc back.
func (sc *scratch) release() {
	clear(sc.args[:cap(sc.args)])
	clear(sc.results[:cap(sc.results)])
	clear(sc.nodes[:cap(sc.nodes)])
	clear(sc.log[:cap(sc.log)]) // its strings point into a shard's arena
	scratchPool.put(sc)
}

// grow returns (*s)[:n] zeroed, reallocating *s when it is too short. With a
// nil s it allocates.
func grow[T any](s *[]T, n int) []T {
	if s == nil {
		return make([]T, n)
	}
	if cap(*s) < n {
		*s = make([]T, n)
	}
	*s = (*s)[:n]
	clear(*s)
	return *s
}
