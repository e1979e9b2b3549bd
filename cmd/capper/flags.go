package main

import (
	"strconv"
	"time"

	"github.com/capper-dev/capper/rules"
)

// optUint is a flag that may be left out: its help shows no default (a
// sentinel such as 1<<63 would read as a real value).
type optUint struct {
	v   uint64
	set bool
}

func (o *optUint) String() string {
	if o == nil || !o.set {
		return ""
	}
	return strconv.FormatUint(o.v, 10)
}

func (o *optUint) Set(s string) error {
	v, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return err
	}
	o.v, o.set = v, true
	return nil
}

// optInt is optUint for a signed value.
type optInt struct {
	v   int
	set bool
}

func (o *optInt) String() string {
	if o == nil || !o.set {
		return ""
	}
	return strconv.Itoa(o.v)
}

func (o *optInt) Set(s string) error {
	v, err := strconv.Atoi(s)
	if err != nil {
		return err
	}
	o.v, o.set = v, true
	return nil
}

// durationFlag reads a duration in the configuration's syntax (500ms, 30s,
// 5m, 24h, 7d): one duration syntax everywhere.
type durationFlag time.Duration

func (d *durationFlag) String() string { return time.Duration(*d).String() }

func (d *durationFlag) Set(s string) error {
	v, err := rules.ParseDuration(s)
	if err != nil {
		return err
	}
	*d = durationFlag(v)
	return nil
}
