package jobs

import (
	"encoding/json"
	"fmt"
	"reflect"
	"runtime"
	"sync"
	"testing"
	"unique"
	"unsafe"
)

// scanSeeds are messages the fast path takes and messages it must leave to
// encoding/json.
var scanSeeds = []string{
	`{"job_id":"j1","user_id":123,"campaign_id":"c","channel":"email","category":"marketing","tags":["promotional","newsletter"],"timezone":"Asia/Kolkata","expires_at":"2026-11-22T18:00:00Z","payload":{"template":"promo-42","vars":{"a":[1,2.5e-3,true,false,null,"x\u00e9\n"]}}}`,
	` { "job_id" : "j" , "user_id" : 0 , "campaign_id" : "c" , "channel" : "e" , "tags" : [ ] } `,
	`{}`, `{"user_id":4294967295}`, `{"user_id":4294967296}`, `{"user_id":012}`, `{"user_id":-1}`, `{"user_id":1.0}`,
	`{"user_id":1e3}`, `{"user_id":"12"}`, `{"user_id":null}`, `{"job_id":null}`, `{"tags":null}`, `{"tags":["a",1]}`,
	`{"JOB_ID":"x"}`, `{"Job_Id":"x","job_id":"y"}`, `{"job_id":"x","job_id":"y"}`, `{"job_\u0069d":"x"}`,
	"{\"job_\u212aid\":\"x\"}", `{"job_id":"caf\u00e9"}`, "{\"job_id\":\"caf\xc3\xa9\"}", "{\"job_id\":\"\xff\"}",
	`{"job_id":"a\"b"}`, `{"payload":"\x"}`, `{"payload":[1,]}`, `{"payload":{"a":}}`, `{"payload":01}`,
	`{"payload":-}`, `{"payload":1.}`, `{"payload":1e}`, `{"payload":tru}`, `{"a":1}{}`, `[1]`, `"x"`, ``, `{`,
	"{\"job_id\":\"a\tb\"}", `{"payload":"\ud800"}`, `{"user_id":99999999999999999999}`, `{"tags":["x"],"tags":["y"]}`,
	`{"expires_at":"2026-11-22T18:00:00.123+05:30","timezone":"UTC"}`, `{"campaign_ends_at":"2027-01-01T00:00:00Z","Campaign_Ends_At":"x"}`, `{"collapse_key":"a","COLLAPSE_KEY":"b"}`,
}

// FuzzScanJobMatchesEncodingJSON: whatever the fast path accepts,
// encoding/json accepts too and reads the same fields. (The seeds run with
// go test; go test -fuzz FuzzScanJobMatchesEncodingJSON ./consumer/ explores.)
func FuzzScanJobMatchesEncodingJSON(f *testing.F) {
	for _, s := range scanSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var fast rawJob
		if !scanJob(data, &fast) {
			return
		}
		var ref rawJob
		if err := json.Unmarshal(data, &ref); err != nil {
			t.Fatalf("fast path accepted %q, encoding/json: %v", data, err)
		}
		if !reflect.DeepEqual(fast, ref) {
			t.Fatalf("%q: fast path read %+v, encoding/json %+v", data, fast, ref)
		}
	})
}

// TestScanJobTakesTheUsualMessages: the fast path must not leave the usual
// message to encoding/json (it would still be right, only slow).
func TestScanJobTakesTheUsualMessages(t *testing.T) {
	for _, s := range scanSeeds[:2] {
		var r rawJob
		if !scanJob([]byte(s), &r) {
			t.Errorf("fast path left %s to encoding/json", s)
		}
	}
}

// TestInternReturnsTheString: intern's cache answers with the string it was
// given, whichever strings share its slots (more of them than the cache has
// slots, each asked twice), one copy per string while that string is
// interned (its unique handle alive: once none is, a collection may drop
// unique's copy and the next call make another), from goroutines at once.
func TestInternReturnsTheString(t *testing.T) {
	n := 4 * len(internCache)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for round := range 2 {
				for i := range n {
					want := fmt.Sprintf("campaign-%d", (i+g*n/4)%n)
					h := unique.Make(want)
					got := intern([]byte(want))
					if got != want {
						t.Errorf("round %d: intern(%q) = %q", round, want, got)
						return
					}
					if again := intern([]byte(want)); unsafe.StringData(again) != unsafe.StringData(got) || unsafe.StringData(got) != unsafe.StringData(h.Value()) {
						t.Errorf("intern(%q) returned two copies", want)
						return
					}
					runtime.KeepAlive(h)
				}
			}
		}()
	}
	wg.Wait()
}
