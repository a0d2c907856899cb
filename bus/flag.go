package bus

// Flag is a level-triggered signal ("a full resync is wanted"): raising it twice
// before it is seen is the same as raising it once, and a raise is never lost.
type Flag struct{ c chan struct{} }

// NewFlag makes a lowered flag.
func NewFlag() *Flag { return &Flag{c: make(chan struct{}, 1)} }

// Raise sets the flag.
func (f *Flag) Raise() {
	select {
	case f.c <- struct{}{}:
	default:
	}
}

// C is ready when the flag is up; receiving from it lowers the flag.
func (f *Flag) C() <-chan struct{} { return f.c }

// Lower lowers the flag and says whether it was up.
func (f *Flag) Lower() bool {
	select {
	case <-f.c:
		return true
	default:
		return false
	}
}
