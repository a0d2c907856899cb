package netfilter

import "encoding/binary"

// nf_tables expressions as iptables-nft 1.8 builds them (libnftnl's encodings),
// from the kernel's uapi linux/netfilter/nf_tables.h.
const (
	nftaMetaDreg = 1 // NFTA_META_DREG
	nftaMetaKey  = 2 // NFTA_META_KEY

	nftMetaMark    = 3  // NFT_META_MARK
	nftMetaIIFName = 6  // NFT_META_IIFNAME
	nftMetaOIFName = 7  // NFT_META_OIFNAME
	nftMetaL4Proto = 16 // NFT_META_L4PROTO

	nftaCmpSreg = 1 // NFTA_CMP_SREG
	nftaCmpOp   = 2 // NFTA_CMP_OP
	nftaCmpData = 3 // NFTA_CMP_DATA

	nftCmpEq  = 0 // NFT_CMP_EQ
	nftCmpNeq = 1 // NFT_CMP_NEQ

	nftaPayloadDreg   = 1 // NFTA_PAYLOAD_DREG
	nftaPayloadBase   = 2 // NFTA_PAYLOAD_BASE
	nftaPayloadOffset = 3 // NFTA_PAYLOAD_OFFSET
	nftaPayloadLen    = 4 // NFTA_PAYLOAD_LEN

	nftPayloadNetworkHeader   = 1 // NFT_PAYLOAD_NETWORK_HEADER
	nftPayloadTransportHeader = 2 // NFT_PAYLOAD_TRANSPORT_HEADER

	nftaBitwiseSreg = 1 // NFTA_BITWISE_SREG
	nftaBitwiseDreg = 2 // NFTA_BITWISE_DREG
	nftaBitwiseLen  = 3 // NFTA_BITWISE_LEN
	nftaBitwiseMask = 4 // NFTA_BITWISE_MASK
	nftaBitwiseXor  = 5 // NFTA_BITWISE_XOR
	nftaBitwiseOp   = 6 // NFTA_BITWISE_OP: the kernel lists it; iptables-nft 1.8.9 leaves it out

	nftaCounterBytes   = 1 // NFTA_COUNTER_BYTES
	nftaCounterPackets = 2 // NFTA_COUNTER_PACKETS

	nftaImmediateDreg = 1 // NFTA_IMMEDIATE_DREG
	nftaImmediateData = 2 // NFTA_IMMEDIATE_DATA

	nftaDataValue   = 1 // NFTA_DATA_VALUE
	nftaDataVerdict = 2 // NFTA_DATA_VERDICT
	nftaVerdictCode = 1 // NFTA_VERDICT_CODE
	nftaVerdictName = 2 // NFTA_VERDICT_CHAIN

	nftaXtName = 1 // NFTA_MATCH_NAME, NFTA_TARGET_NAME
	nftaXtRev  = 2 // NFTA_MATCH_REV, NFTA_TARGET_REV
	nftaXtInfo = 3 // NFTA_MATCH_INFO, NFTA_TARGET_INFO

	nftaRuleCompatProto = 1 // NFTA_RULE_COMPAT_PROTO
	nftaRuleCompatFlags = 2 // NFTA_RULE_COMPAT_FLAGS
	nftRuleCompatInv    = 1 // NFT_RULE_COMPAT_F_INV

	nftRegVerdict = 0 // NFT_REG_VERDICT
	nftReg1       = 1 // NFT_REG_1: iptables-nft loads everything into it
)

// Verdict codes (NF_DROP, NF_ACCEPT and nf_tables' own, negative).
const (
	verdictDrop   int32 = 0
	verdictAccept int32 = 1
	verdictJump   int32 = -3
	verdictReturn int32 = -5
)

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
	verdictExprs = map[string]expr{
		"ACCEPT": verdict(verdictAccept, ""),
		"DROP":   verdict(verdictDrop, ""),
		"RETURN": verdict(verdictReturn, ""),
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
			d := n.begin(nftaImmediateData)
			v := n.begin(nftaDataVerdict)
			n.u32(nftaVerdictCode, uint32(code))
			if chain != "" {
				n.str(nftaVerdictName, chain)
			}
			n.end(v)
			n.end(d)
		})
	}
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
