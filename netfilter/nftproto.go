package netfilter

// The nf_tables netlink protocol's numbers, in one place for the reader
// (digest.go, nftdump.go) and the writer (nftwrite.go, nftrule.go, nftexpr.go),
// from the kernel's uapi linux/netfilter/nf_tables.h and nfnetlink.h
// (golang.org/x/sys/unix has them too, but is not a direct dependency).
const (
	nfnlSubsysNFTables = 10 // NFNL_SUBSYS_NFTABLES
	nfprotoIPv4        = 2  // NFPROTO_IPV4
	nfprotoIPv6        = 10 // NFPROTO_IPV6

	nfnlMsgBatchBegin = 0x10 // NFNL_MSG_BATCH_BEGIN
	nfnlMsgBatchEnd   = 0x11 // NFNL_MSG_BATCH_END

	nftMsgNewTable = 0    // NFT_MSG_NEWTABLE
	nftMsgDelTable = 2    // NFT_MSG_DELTABLE
	nftMsgNewChain = 3    // NFT_MSG_NEWCHAIN: how the kernel answers GETCHAIN
	nftMsgDelChain = 5    // NFT_MSG_DELCHAIN
	nftMsgDelRule  = 8    // NFT_MSG_DELRULE
	nftMsgGetChain = 4    // NFT_MSG_GETCHAIN
	nftMsgNewRule  = 6    // NFT_MSG_NEWRULE: how the kernel answers GETRULE
	nftMsgGetRule  = 7    // NFT_MSG_GETRULE
	nftMsgNewGen   = 0x0f // NFT_MSG_NEWGEN
	nftMsgGetGen   = 0x10 // NFT_MSG_GETGEN

	nftMsgNewSet     = 9  // NFT_MSG_NEWSET
	nftMsgDelSet     = 11 // NFT_MSG_DELSET
	nftMsgNewSetElem = 12 // NFT_MSG_NEWSETELEM
	nftMsgDelSetElem = 14 // NFT_MSG_DELSETELEM

	nftaTableName  = 1 // NFTA_TABLE_NAME
	nftaChainTable = 1 // NFTA_CHAIN_TABLE
	nftaChainName  = 3 // NFTA_CHAIN_NAME

	nftaRuleTable       = 1 // NFTA_RULE_TABLE
	nftaRuleChain       = 2 // NFTA_RULE_CHAIN
	nftaRuleHandle      = 3 // NFTA_RULE_HANDLE
	nftaRuleExpressions = 4 // NFTA_RULE_EXPRESSIONS
	nftaRuleCompat      = 5 // NFTA_RULE_COMPAT
	nftaRuleUserdata    = 7 // NFTA_RULE_USERDATA

	nftaListElem = 1 // NFTA_LIST_ELEM
	nftaExprName = 1 // NFTA_EXPR_NAME
	nftaExprData = 2 // NFTA_EXPR_DATA

	nftaGenID = 1 // NFTA_GEN_ID

	nftaTableFlags    = 2 // NFTA_TABLE_FLAGS
	nftaTableUserdata = 6 // NFTA_TABLE_USERDATA

	nftaChainHook     = 4  // NFTA_CHAIN_HOOK
	nftaChainType     = 7  // NFTA_CHAIN_TYPE
	nftaChainUserdata = 12 // NFTA_CHAIN_USERDATA
	nftaHookHooknum   = 1  // NFTA_HOOK_HOOKNUM
	nftaHookPriority  = 2  // NFTA_HOOK_PRIORITY

	nftaSetTable    = 1  // NFTA_SET_TABLE
	nftaSetName     = 2  // NFTA_SET_NAME
	nftaSetFlags    = 3  // NFTA_SET_FLAGS
	nftaSetKeyType  = 4  // NFTA_SET_KEY_TYPE
	nftaSetKeyLen   = 5  // NFTA_SET_KEY_LEN
	nftaSetDataType = 6  // NFTA_SET_DATA_TYPE
	nftaSetDataLen  = 7  // NFTA_SET_DATA_LEN
	nftaSetID       = 10 // NFTA_SET_ID: the kernel requires one, unique in the transaction
	nftaSetTimeout  = 11 // NFTA_SET_TIMEOUT, in milliseconds
	nftaSetUserdata = 13 // NFTA_SET_USERDATA

	nftSetMap     = 0x08 // NFT_SET_MAP
	nftSetTimeout = 0x10 // NFT_SET_TIMEOUT
	nftSetEval    = 0x20 // NFT_SET_EVAL: nft's "dynamic"

	nftDataVerdictType = 0xffffff00 // NFT_DATA_VERDICT, a verdict map's data type

	nftaSetElemListTable    = 1 // NFTA_SET_ELEM_LIST_TABLE
	nftaSetElemListSet      = 2 // NFTA_SET_ELEM_LIST_SET
	nftaSetElemListElements = 3 // NFTA_SET_ELEM_LIST_ELEMENTS
	nftaSetElemKey          = 1 // NFTA_SET_ELEM_KEY
	nftaSetElemData         = 2 // NFTA_SET_ELEM_DATA
	nftaSetElemUserdata     = 6 // NFTA_SET_ELEM_USERDATA

	nfgenmsgLen = 4 // struct nfgenmsg: family, version, res_id (big-endian)
)

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
	verdictGoto   int32 = -4
	verdictReturn int32 = -5
)

// libnftnl's userdata: the TLVs (type, length: one byte each) nft keeps in an
// object's NFTA_*_USERDATA, from libnftnl's udata.h.
const (
	udataComment       = 0 // NFTNL_UDATA_TABLE_COMMENT, _CHAIN_COMMENT, _SET_ELEM_COMMENT
	udataSetKeyOrder   = 0 // NFTNL_UDATA_SET_KEYBYTEORDER
	udataSetDataOrder  = 1 // NFTNL_UDATA_SET_DATABYTEORDER
	udataSetComment    = 7 // NFTNL_UDATA_SET_COMMENT
	byteorderBigEndian = 2 // nft's BYTEORDER_BIG_ENDIAN; BYTEORDER_INVALID (0) for a concatenation
)
