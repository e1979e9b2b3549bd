// Package segments tells which segment (new, active, dormant, ...) a user
// belongs to, from roaring bitmaps that a data pipeline writes to S3 or a
// local directory.
//
// Each segment is one object, <prefix>/<segment>.roaring, in the portable
// roaring serialization (RoaringFormatSpec) that Java RoaringBitmap, CRoaring,
// pyroaring and roaring for Go write. User ids are unsigned 32-bit integers.
//
// All configured segments are loaded together into an immutable Snapshot that
// a Store publishes through an atomic pointer: lookups are lock-free and safe
// for concurrent use. A Store polls its source, downloads only the objects
// whose ETag changed, builds the next snapshot completely and swaps it in; a
// failed refresh keeps the previous snapshot. A snapshot is never partial.
package segments
