package netfilter

import "encoding/binary"

// expr appends one nf_tables expression (an NFTA_LIST_ELEM) to a rule.
type expr func(n *nlBuf)

// element appends an expression: its name, and the attributes data writes.
func element(n *nlBuf, name string, data func(n *nlBuf)) {
	at := n.begin(nftaListElem)
	n.str(nftaExprName, name)
	d := n.begin(nftaExprData)
	data(n)
	n.end(d)
	n.end(at)
}

// constant encodes an expression once; every use appends the same bytes.
func constant(name string, data func(n *nlBuf)) expr {
	var once nlBuf
	element(&once, name, data)
	return func(n *nlBuf) { n.b = append(n.b, once.b...) }
}

var (
	loadL4Proto = metaLoad(nftMetaL4Proto)
	loadMark    = metaLoad(nftMetaMark)
	loadIIFName = metaLoad(nftMetaIIFName)
	loadOIFName = metaLoad(nftMetaOIFName)
	loadDPort   = payloadLoad(nftPayloadTransportHeader, 2, 2)

	// counter is the counter iptables-nft puts in every rule, before its target.
	counter = constant("counter", func(n *nlBuf) {
		n.u64(nftaCounterBytes, 0)
		n.u64(nftaCounterPackets, 0)
	})
	verdictExprs = map[TargetKind]expr{
		TargetAccept: verdict(verdictAccept, ""),
		TargetDrop:   verdict(verdictDrop, ""),
		TargetReturn: verdict(verdictReturn, ""),
	}
)

func metaLoad(key uint32) expr {
	return constant("meta", func(n *nlBuf) {
		n.u32(nftaMetaKey, key)
		n.u32(nftaMetaDreg, nftReg1)
	})
}

func payloadLoad(base, offset, length uint32) expr {
	return constant("payload", func(n *nlBuf) {
		n.u32(nftaPayloadDreg, nftReg1)
		n.u32(nftaPayloadBase, base)
		n.u32(nftaPayloadOffset, offset)
		n.u32(nftaPayloadLen, length)
	})
}

func cmp(op uint32, value []byte) expr {
	return func(n *nlBuf) {
		element(n, "cmp", func(n *nlBuf) {
			n.u32(nftaCmpSreg, nftReg1)
			n.u32(nftaCmpOp, op)
			d := n.begin(nftaCmpData)
			n.attr(nftaDataValue, value)
			n.end(d)
		})
	}
}

// bitwise is reg1 = (reg1 & mask) ^ 0.
func bitwise(mask []byte) expr {
	return func(n *nlBuf) {
		element(n, "bitwise", func(n *nlBuf) {
			n.u32(nftaBitwiseSreg, nftReg1)
			n.u32(nftaBitwiseDreg, nftReg1)
			n.u32(nftaBitwiseLen, uint32(len(mask)))
			d := n.begin(nftaBitwiseMask)
			n.attr(nftaDataValue, mask)
			n.end(d)
			d = n.begin(nftaBitwiseXor)
			n.padded(nftaDataValue, nil, len(mask))
			n.end(d)
		})
	}
}

// verdict is an immediate verdict; chain is the target of a jump.
func verdict(code int32, chain string) expr {
	return func(n *nlBuf) {
		element(n, "immediate", func(n *nlBuf) {
			n.u32(nftaImmediateDreg, nftRegVerdict)
			verdictData(n, nftaImmediateData, code, chain)
		})
	}
}

// verdictData appends a verdict as data (an immediate's, a map element's).
func verdictData(n *nlBuf, typ uint16, code int32, chain string) {
	d := n.begin(typ)
	v := n.begin(nftaDataVerdict)
	n.u32(nftaVerdictCode, uint32(code))
	if chain != "" {
		n.str(nftaVerdictName, chain)
	}
	n.end(v)
	n.end(d)
}

// xt is an x_tables match or target run by nft_compat ("match" or "target"),
// with its revision and info structure.
func xt(kind, name string, rev uint32, info []byte) expr {
	return func(n *nlBuf) {
		element(n, kind, func(n *nlBuf) {
			n.str(nftaXtName, name)
			n.u32(nftaXtRev, rev)
			n.attr(nftaXtInfo, info)
		})
	}
}

// commentMatch is xt_comment (rev 0): struct xt_comment_info, char comment[256].
func commentMatch(comment string) expr {
	return func(n *nlBuf) {
		element(n, "match", func(n *nlBuf) {
			n.str(nftaXtName, "comment")
			n.u32(nftaXtRev, 0)
			n.b = binary.NativeEndian.AppendUint16(n.b, nlaHdrLen+256)
			n.b = binary.NativeEndian.AppendUint16(n.b, nftaXtInfo)
			n.b = append(n.b, comment...)
			n.zeros(256 - len(comment))
		})
	}
}
