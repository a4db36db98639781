//! The protocol fuzz test's parts: what peers send (`gen`), how a peer plays it and checks the
//! replies (`peer`), and the daemon's configuration and the rules every status must show kept
//! (`rules`).

pub mod gen;
pub mod peer;
pub mod rules;
