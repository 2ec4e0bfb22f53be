//! A streamed answer: the events of every choice merged into one stream of server-sent events,
//! framed as OpenAI's ([`crate::api::Delta`]), until every choice is over, the client leaves or
//! the server shuts down.

use std::future::Future;
use std::time::{Duration, Instant};

use ember_data::Tokenizer;
use ember_generate::engine::Event;
use ember_http::{race, Either};
use hyper::body::Bytes;
use tokio::sync::mpsc;

use crate::answer::{distinct_prompt_tokens, merge, Failed, Follow, Shape, Submitted};
use crate::api::{error_body, ChunkHead, Delta, Kind, Usage};
use crate::server::SHUTTING_DOWN;
use crate::worker::Worker;

/// What a streamed answer needs once its request has gone.
pub(crate) struct Answering {
    pub head: ChunkHead,
    pub shape: Shape,
    pub tokenizer: Tokenizer,
    pub worker: Worker,
    pub user: Option<String>,
}

impl Answering {
    fn event(&self, index: usize, delta: &Delta) -> Bytes {
        let chunk = self.shape.kind.chunk(&self.head, index, delta);
        Bytes::from(format!("data: {chunk}\n\n"))
    }

    /// Streams the answer's events into `tx` until every choice is over, the client leaves or
    /// `cut` resolves (then a last error event says the server is shutting down), and logs how it
    /// ended.
    pub async fn stream(self, subs: Vec<Submitted>, tx: mpsc::Sender<Bytes>, cut: impl Future<Output = ()>) {
        let start = Instant::now();
        let prompt = distinct_prompt_tokens(&subs);
        let mut generated = 0;
        let ended = self.events(subs, &tx, cut, &mut generated).await;
        let (id, ms) = (&self.head.id, start.elapsed().as_millis());
        let user = self.user.as_deref().map(|u| format!(" (user `{u}`)")).unwrap_or_default();
        tracing::info!("{id}{user}: {ended} after {ms} ms: {prompt} prompt + {generated} completion tokens");
    }

    async fn events(
        &self,
        mut subs: Vec<Submitted>,
        tx: &mpsc::Sender<Bytes>,
        cut: impl Future<Output = ()>,
        generated: &mut usize,
    ) -> &'static str {
        let _cancel = CancelOnDrop { worker: &self.worker, ids: subs.iter().map(|s| s.id).collect() };
        let prompt_tokens = distinct_prompt_tokens(&subs);
        let mut follows: Vec<Follow<'_>> =
            subs.iter().map(|s| Follow::new(&self.tokenizer, &self.shape, s.index, &s.prompt)).collect();
        let ids: Vec<u64> = subs.iter().map(|s| s.id).collect();
        let mut merged = merge(&mut subs);
        let mut open = follows.len();
        let mut counts = vec![0usize; follows.len()];
        let mut cut = std::pin::pin!(cut);
        if self.shape.kind == Kind::Chat {
            for f in &follows {
                if !send_within(tx, self.event(f.index, &Delta::Role)).await {
                    return "the client disconnected";
                }
            }
        }
        while open > 0 {
            // A client that leaves while its request waits in the queue sends nothing to notice:
            // the body's end going away says so.
            let next = race(merged.recv(), race(tx.closed(), cut.as_mut())).await;
            let (k, event) = match next {
                Either::Left(Some(next)) => next,
                Either::Left(None) => return "ended by a failed decoding step",
                Either::Right(Either::Left(())) => return "the client disconnected",
                Either::Right(Either::Right(())) => {
                    let last = error_body("server_error", SHUTTING_DOWN, None, Some("server_shutdown"));
                    let _ = send_within(tx, Bytes::from(format!("data: {last}\n\n"))).await;
                    let _ = send_within(tx, Bytes::from_static(b"data: [DONE]\n\n")).await;
                    return "ended by the server's shutdown";
                }
            };
            if counts[k] == usize::MAX {
                continue; // over already (a stop string): the rest of its events are dropped
            }
            if matches!(event, Some(Event::Token { .. })) {
                counts[k] += 1;
            }
            let step = match follows[k].on(event) {
                Ok(step) => step,
                Err(Failed { message, client }) => {
                    let failed = match client {
                        true => error_body("invalid_request_error", &message, Some("logit_bias"), None),
                        false => error_body("server_error", &message, None, None),
                    };
                    let _ = send_within(tx, Bytes::from(format!("data: {failed}\n\n"))).await;
                    return "ended by a failed decoding step";
                }
            };
            for d in &step.deltas {
                if !send_within(tx, self.event(follows[k].index, d)).await {
                    return "the client disconnected";
                }
            }
            if let Some((finish, n)) = step.done {
                self.worker.cancel(ids[k]);
                *generated += n.max(counts[k]);
                counts[k] = usize::MAX;
                open -= 1;
                if !send_within(tx, self.event(follows[k].index, &Delta::Finish(finish))).await {
                    return "the client disconnected";
                }
            }
        }
        if self.head.with_usage {
            let usage = self.shape.kind.usage_chunk(&self.head, Usage::new(prompt_tokens, *generated));
            let _ = send_within(tx, Bytes::from(format!("data: {usage}\n\n"))).await;
        }
        let _ = send_within(tx, Bytes::from_static(b"data: [DONE]\n\n")).await;
        "finished"
    }
}

/// Cancels the requests of an answer when it is dropped: over (harmless), or abandoned by its
/// client.
pub(crate) struct CancelOnDrop<'a> {
    pub worker: &'a Worker,
    pub ids: Vec<u64>,
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        self.ids.iter().for_each(|&id| self.worker.cancel(id));
    }
}

/// How long a streamed piece may wait for a client that does not read before the answer (and its
/// request) is given up.
const STALL: Duration = Duration::from_secs(30);

/// Sends one piece of a streamed answer; false when the client is gone or has not taken what was
/// sent before for [`STALL`].
pub(crate) async fn send_within(tx: &mpsc::Sender<Bytes>, piece: Bytes) -> bool {
    matches!(tokio::time::timeout(STALL, tx.send(piece)).await, Ok(Ok(())))
}
