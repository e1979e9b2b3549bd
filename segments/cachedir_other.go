//go:build !unix

package segments

import (
	"errors"
	"os"
)

// tryLock: no locks here; a cache directory is neither checked nor swept.
func tryLock(*os.File) (bool, error) { return false, errors.ErrUnsupported }
