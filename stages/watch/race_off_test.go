//go:build !race

package watch

const raceDetector = false
