//go:build race

package render

// raceDetector: this test binary runs under the race detector, where the
// 10,000-service tests take minutes (they run without it in `task unit`).
const raceDetector = true
