// Package nftables renders what kube-proxy v1.34's nftables mode writes into its
// table kube-proxy at a full sync on a fresh node: the table, its base and fixed
// chains, the fixed sets and verdict maps with their elements, and each service
// port's chains (service-, local-, external-, firewall-, endpoint-) and affinity
// sets, named and hashed as kube-proxy names them (docs/kube-proxy-nftables-v1.34.md
// is the fact sheet this follows).
//
// Render is a pure function of the snapshot's state and a Config, and picks
// endpoints with stages/render's selection, so both modes send a service's
// traffic to the same endpoints. The result is an object model (Table, Chain,
// Set, Element, Rule) for a netlink writer; Table.Dump prints it as kube-proxy's
// own tests print theirs, which the tests compare with upstream's expected output.
//
// Not wired into the daemon yet: kpipe still refuses mode: nftables.
package nftables
