//go:build unix

package segments

import (
	"errors"
	"os"
	"syscall"
)

// tryLock takes an exclusive lock on f without waiting: false when another
// open file holds it. The kernel releases it when f is closed or its process ends.
func tryLock(f *os.File) (bool, error) {
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		switch {
		case err == nil:
			return true, nil
		case errors.Is(err, syscall.EWOULDBLOCK):
			return false, nil
		case errors.Is(err, syscall.EINTR):
			continue
		default:
			return false, err
		}
	}
}
