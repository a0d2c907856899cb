package netfilter

import (
	"encoding/binary"
)

// nlBuf builds netlink messages and attributes by appending to one buffer: a
// full sync writes hundreds of thousands of rules, and building each attribute
// as its own slice costs more than the kernel takes to apply them.
type nlBuf struct{ b []byte }

const nlaHdrLen = 4

// nlaNested is NLA_F_NESTED, set on attributes that hold attributes.
const nlaNested = 0x8000

func align4(n int) int { return (n + 3) &^ 3 }

// attr appends an attribute with payload v.
func (n *nlBuf) attr(typ uint16, v []byte) {
	n.b = binary.NativeEndian.AppendUint16(n.b, uint16(nlaHdrLen+len(v)))
	n.b = binary.NativeEndian.AppendUint16(n.b, typ)
	n.b = append(n.b, v...)
	n.pad()
}

func (n *nlBuf) pad() {
	for len(n.b)%4 != 0 {
		n.b = append(n.b, 0)
	}
}

// str appends a NUL-terminated string attribute.
func (n *nlBuf) str(typ uint16, s string) {
	n.b = binary.NativeEndian.AppendUint16(n.b, uint16(nlaHdrLen+len(s)+1))
	n.b = binary.NativeEndian.AppendUint16(n.b, typ)
	n.b = append(n.b, s...)
	n.b = append(n.b, 0)
	n.pad()
}

// u32 appends a big-endian 32-bit attribute (nf_tables numbers are).
func (n *nlBuf) u32(typ uint16, v uint32) {
	n.b = binary.NativeEndian.AppendUint16(n.b, nlaHdrLen+4)
	n.b = binary.NativeEndian.AppendUint16(n.b, typ)
	n.b = binary.BigEndian.AppendUint32(n.b, v)
}

// u64 appends a big-endian 64-bit attribute.
func (n *nlBuf) u64(typ uint16, v uint64) {
	n.b = binary.NativeEndian.AppendUint16(n.b, nlaHdrLen+8)
	n.b = binary.NativeEndian.AppendUint16(n.b, typ)
	n.b = binary.BigEndian.AppendUint64(n.b, v)
}

// padded appends an attribute of v followed by zeros up to size bytes.
func (n *nlBuf) padded(typ uint16, v []byte, size int) {
	n.b = binary.NativeEndian.AppendUint16(n.b, uint16(nlaHdrLen+size))
	n.b = binary.NativeEndian.AppendUint16(n.b, typ)
	n.b = append(n.b, v...)
	n.zeros(size - len(v))
	n.pad()
}

// zeroBytes is a source of zeros to append from.
var zeroBytes [512]byte

// zeros appends k zero bytes.
func (n *nlBuf) zeros(k int) {
	for k > 0 {
		c := min(k, len(zeroBytes))
		n.b = append(n.b, zeroBytes[:c]...)
		k -= c
	}
}

// begin starts a nested attribute; end closes it.
func (n *nlBuf) begin(typ uint16) int {
	at := len(n.b)
	n.b = append(n.b, 0, 0, 0, 0)
	binary.NativeEndian.PutUint16(n.b[at+2:], typ|nlaNested)
	return at
}

func (n *nlBuf) end(at int) {
	binary.NativeEndian.PutUint16(n.b[at:], uint16(len(n.b)-at))
}

// msg starts a netlink message with an nfgenmsg header; done closes it.
func (n *nlBuf) msg(typ, flags uint16, seq uint32, family uint8, resID uint16) int {
	at := len(n.b)
	n.b = binary.NativeEndian.AppendUint32(n.b, 0)
	n.b = binary.NativeEndian.AppendUint16(n.b, typ)
	n.b = binary.NativeEndian.AppendUint16(n.b, flags)
	n.b = binary.NativeEndian.AppendUint32(n.b, seq)
	n.b = binary.NativeEndian.AppendUint32(n.b, 0) // the kernel fills in the port
	n.b = append(n.b, family, 0)
	n.b = binary.BigEndian.AppendUint16(n.b, resID)
	return at
}

func (n *nlBuf) done(at int) {
	binary.NativeEndian.PutUint32(n.b[at:], uint32(len(n.b)-at))
}
