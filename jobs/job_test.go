package jobs_test

import (
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/capper-dev/capper/jobs"
)

var kolkata, _ = time.LoadLocation("Asia/Kolkata")

func TestDecode(t *testing.T) {
	tests := []struct {
		name, in string
		want     jobs.Job
		err      string
	}{
		{"full", `{"job_id":"j1","user_id":4294967295,"campaign_id":"c","channel":"push","category":"transactional","payload":{"a":1}}`,
			jobs.Job{JobID: "j1", UserID: 4294967295, CampaignID: "c", Channel: "push", Category: "transactional"}, ""},
		{"default category", `{"job_id":"j1","user_id":0,"campaign_id":"c","channel":"email"}`,
			jobs.Job{JobID: "j1", UserID: 0, CampaignID: "c", Channel: "email", Category: "marketing"}, ""},
		{"not json", `hello`, jobs.Job{}, "not a JSON object"},
		{"array", `[1,2]`, jobs.Job{}, "not a JSON object"},
		{"trailing", `{"job_id":"j","user_id":1,"campaign_id":"c","channel":"e"} {}`, jobs.Job{}, "not a JSON object"},
		{"no job id", `{"user_id":1,"campaign_id":"c","channel":"e"}`, jobs.Job{}, "job_id is missing"},
		{"long job id", `{"job_id":"` + strings.Repeat("x", 129) + `","user_id":1,"campaign_id":"c","channel":"e"}`, jobs.Job{}, "at most 128"},
		{"no user", `{"job_id":"j","campaign_id":"c","channel":"e"}`, jobs.Job{}, "user_id is missing"},
		{"negative user", `{"job_id":"j","user_id":-1,"campaign_id":"c","channel":"e"}`, jobs.Job{}, "not an integer in 0..4294967295"},
		{"user too big", `{"job_id":"j","user_id":4294967296,"campaign_id":"c","channel":"e"}`, jobs.Job{}, "not an integer"},
		{"fractional user", `{"job_id":"j","user_id":1.5,"campaign_id":"c","channel":"e"}`, jobs.Job{}, "not an integer"},
		{"string user", `{"job_id":"j","user_id":"12","campaign_id":"c","channel":"e"}`, jobs.Job{}, "not a number"},
		{"no campaign", `{"job_id":"j","user_id":1,"channel":"e"}`, jobs.Job{}, "campaign_id"},
		{"no channel", `{"job_id":"j","user_id":1,"campaign_id":"c"}`, jobs.Job{}, "channel"},
		{"wrong type", `{"job_id":5,"user_id":1,"campaign_id":"c","channel":"e"}`, jobs.Job{}, "job_id must be a string, not number"},
		{"user id as exponent", `{"job_id":"j","user_id":1e3,"campaign_id":"c","channel":"e"}`, jobs.Job{JobID: "j", UserID: 1000, CampaignID: "c", Channel: "e", Category: "marketing"}, ""},
		{"invalid payload", `{"job_id":"j","user_id":1,"campaign_id":"c","channel":"e","payload":{"a":}}`, jobs.Job{}, "not a JSON object"},
		{"null user", `{"job_id":"j","user_id":null,"campaign_id":"c","channel":"e"}`, jobs.Job{}, "user_id"},
		{"tags and a time zone", `{"job_id":"j","user_id":1,"campaign_id":"c","channel":"e","tags":["promotional","newsletter"],"timezone":"Asia/Kolkata"}`,
			jobs.Job{JobID: "j", UserID: 1, CampaignID: "c", Channel: "e", Category: "marketing", Tags: []string{"promotional", "newsletter"}, Timezone: "Asia/Kolkata", Zone: kolkata}, ""},
		{"unknown time zone", `{"job_id":"j","user_id":1,"campaign_id":"c","channel":"e","timezone":"Mars/Olympus"}`, jobs.Job{}, `unknown time zone "Mars/Olympus"`},
		{"too many tags", `{"job_id":"j","user_id":1,"campaign_id":"c","channel":"e","tags":["a","b","c","d","e","f","g","h","i"]}`, jobs.Job{}, "9 tags, at most 8"},
		{"empty tag", `{"job_id":"j","user_id":1,"campaign_id":"c","channel":"e","tags":[""]}`, jobs.Job{}, "is not 1..64 bytes"},
		{"long tag", `{"job_id":"j","user_id":1,"campaign_id":"c","channel":"e","tags":["` + strings.Repeat("t", 65) + `"]}`, jobs.Job{}, "is not 1..64 bytes"},
		{"priority", `{"job_id":"j","user_id":1,"campaign_id":"c","channel":"e","priority":7}`,
			jobs.Job{JobID: "j", UserID: 1, CampaignID: "c", Channel: "e", Category: "marketing", Priority: 7, HasPriority: true}, ""},
		{"priority 0", `{"job_id":"j","user_id":1,"campaign_id":"c","channel":"e","priority":0}`,
			jobs.Job{JobID: "j", UserID: 1, CampaignID: "c", Channel: "e", Category: "marketing", HasPriority: true}, ""},
		{"priority too high", `{"job_id":"j","user_id":1,"campaign_id":"c","channel":"e","priority":101}`, jobs.Job{}, "priority must be an integer in 0..100"},
		{"negative priority", `{"job_id":"j","user_id":1,"campaign_id":"c","channel":"e","priority":-1}`, jobs.Job{}, "priority must be an integer in 0..100"},
		{"priority as a string", `{"job_id":"j","user_id":1,"campaign_id":"c","channel":"e","priority":"7"}`, jobs.Job{}, "priority must be an integer in 0..100"},
		{"campaign end", `{"job_id":"j","user_id":1,"campaign_id":"c","channel":"e","campaign_ends_at":"2027-01-31T23:00:00Z"}`,
			jobs.Job{JobID: "j", UserID: 1, CampaignID: "c", Channel: "e", Category: "marketing", CampaignEndsAt: time.Date(2027, 1, 31, 23, 0, 0, 0, time.UTC)}, ""},
		{"collapse key", `{"job_id":"j","user_id":1,"campaign_id":"c","channel":"e","collapse_key":"price-drop:sku-1"}`,
			jobs.Job{JobID: "j", UserID: 1, CampaignID: "c", Channel: "e", Category: "marketing", CollapseKey: "price-drop:sku-1"}, ""},
		{"long collapse key", `{"job_id":"j","user_id":1,"campaign_id":"c","channel":"e","collapse_key":"` + strings.Repeat("k", 129) + `"}`, jobs.Job{}, "collapse_key is 129 bytes, at most 128"},
		{"bad campaign end", `{"job_id":"j","user_id":1,"campaign_id":"c","channel":"e","campaign_ends_at":"January"}`, jobs.Job{}, `campaign_ends_at "January" is not an RFC 3339 time`},
		{"escapes and non-ASCII in the payload", `{"job_id":"j","user_id":1,"campaign_id":"c","channel":"e","payload":{"q":"say \"hi\"\n","\u00e9t\u00e9":"été \\ ✓"}}`,
			jobs.Job{JobID: "j", UserID: 1, CampaignID: "c", Channel: "e", Category: "marketing"}, ""},
		{"control byte in a string", "{\"job_id\":\"j\",\"user_id\":1,\"campaign_id\":\"c\",\"channel\":\"e\",\"payload\":\"a\tb\"}", jobs.Job{}, "not a JSON object"},
		{"string not ended", `{"job_id":"j","user_id":1,"campaign_id":"c","channel":"e","payload":"abc`, jobs.Job{}, "not a JSON object"},
		{"bad escape", `{"job_id":"j","user_id":1,"campaign_id":"c","channel":"e","payload":"\x41"}`, jobs.Job{}, "not a JSON object"},
		{"tags not a list", `{"job_id":"j","user_id":1,"campaign_id":"c","channel":"e","tags":"promotional"}`, jobs.Job{}, "tags must be a list of strings"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := jobs.Decode([]byte(tt.in), 1<<20)
			if tt.err != "" {
				if err == nil || !errors.Is(err, jobs.ErrMalformed) || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("err = %v, want malformed: %q", err, tt.err)
				}
				return
			}
			if err != nil || !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("got %+v, %v; want %+v", got, err, tt.want)
			}
		})
	}
	if _, err := jobs.Decode(make([]byte, 100), 50); err == nil || !strings.Contains(err.Error(), "exceeds") {
		t.Fatalf("oversize: %v", err)
	}
}

func FuzzDecode(f *testing.F) {
	f.Add([]byte(`{"job_id":"j1","user_id":123,"campaign_id":"c","channel":"email","payload":{}}`))
	f.Add([]byte(`{"job_id":"","user_id":-1}`))
	f.Add([]byte(`{"user_id":1e300}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		j, err := jobs.Decode(data, 4096)
		if err != nil {
			if !errors.Is(err, jobs.ErrMalformed) {
				t.Fatalf("error %v does not wrap ErrMalformed", err)
			}
			return
		}
		if j.JobID == "" || len(j.JobID) > jobs.MaxJobIDBytes || j.Channel == "" || j.CampaignID == "" || j.Category == "" {
			t.Fatalf("accepted an invalid job %+v", j)
		}
	})
}

func TestAppendAllTags(t *testing.T) {
	var all []string
	all = jobs.AppendAllTags(all, "marketing", []string{"promotional", "marketing", "promotional", "newsletter"})
	n := len(all)
	all = jobs.AppendAllTags(all, "promotional", []string{"newsletter", "marketing"}) // repeats the first job's, not its own
	if got, want := strings.Join(all[:n], ","), "marketing,promotional,newsletter"; got != want {
		t.Errorf("first job's tags %q, want %q", got, want)
	}
	if got, want := strings.Join(all[n:], ","), "promotional,newsletter,marketing"; got != want {
		t.Errorf("second job's tags %q, want %q", got, want)
	}
	if got := jobs.AllTags("receipt", nil); !reflect.DeepEqual(got, []string{"receipt"}) {
		t.Errorf("AllTags without tags = %q", got)
	}
}

func BenchmarkDecode(b *testing.B) {
	msg := []byte(`{"job_id":"blast-42:user-1234567:email","user_id":1234567,"campaign_id":"blast-42","channel":"email","category":"marketing","payload":{"template":"promo-42","vars":{"name":"Ana","offer":"20%"}}}`)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := jobs.Decode(msg, 1<<20); err != nil {
			b.Fatal(err)
		}
	}
}
