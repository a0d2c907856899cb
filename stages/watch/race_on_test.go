//go:build race

package watch

// raceDetector: the race detector multiplies what each allocation costs, so a
// heap bound measured without it does not hold under it.
const raceDetector = true
