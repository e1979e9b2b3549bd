// Package jobs reads the send jobs of capper's input topic: Decode parses and
// validates one message value into a Job, on a one-pass scanner for the
// messages schedulers write and encoding/json for everything else (the two
// are held together by a fuzz test). It also holds what jobs and the events
// of package events share: the bounds of their fields, their tags as the log
// records them (AllTags), and ErrMalformed, which every reason a message can
// never be decided wraps.
package jobs
