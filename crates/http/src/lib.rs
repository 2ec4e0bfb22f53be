//! The HTTP shell of ember's servers (the dashboard, the OpenAI-compatible server): a listener on a
//! tokio runtime of its own, connection limits and deadlines, a `Host` allow-list, and a handle
//! that stops the server when dropped. A server is a [`Service`] that answers what passes the
//! shell's checks; [`Server::start`] runs it.

mod conn;
mod hosts;
mod server;

pub use conn::{Conn, Idle, Working};
pub use server::{race, Drained, Either, Limits, Priority, Refused, Server, Service, Settings, StartError};
