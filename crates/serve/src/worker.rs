//! The thread that owns the model: it runs the continuous-batching [`Engine`], takes requests and
//! cancels from the HTTP side over a channel, and routes each request's events back to it. A
//! request whose receiver is gone (the client disconnected) is cancelled at its next token.

use std::collections::HashMap;
use std::sync::{mpsc, Arc, Mutex};

use ember_generate::engine::{CacheUse, Engine, EngineError, Event, Request, RequestId};
use ember_kernels::EmberBackend;
use tokio::sync::{mpsc as tmpsc, oneshot};

pub enum Command {
    Submit {
        request: Request,
        events: tmpsc::UnboundedSender<Event>,
        reply: oneshot::Sender<Result<RequestId, EngineError>>,
    },
    Cancel(RequestId),
}

/// The HTTP side's end of the channel to the engine thread.
#[derive(Clone)]
pub struct Worker {
    tx: mpsc::Sender<Command>,
    /// The engine's cache use after its last step.
    usage: Arc<Mutex<CacheUse>>,
    /// Requests the engine takes at once, running and waiting.
    capacity: usize,
}

impl Worker {
    /// Starts the engine's thread; it ends when every `Worker` clone is dropped and the engine is idle.
    pub fn spawn<B: EmberBackend>(engine: Engine<B>) -> std::io::Result<Self>
    where
        Engine<B>: Send + 'static,
    {
        let (tx, rx) = mpsc::channel();
        let capacity = engine.capacity();
        let usage = Arc::new(Mutex::new(engine.cache_use()));
        let shared = usage.clone();
        std::thread::Builder::new()
            .name("ember-engine".into())
            .spawn(move || ember_kernels::on_cpu_workers(move || serve(engine, rx, &shared)))?;
        Ok(Self { tx, usage, capacity })
    }

    /// Requests the engine takes at once, running and waiting: one answer's choices at most.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The engine's KV-cache use as of its last step: blocks held now and at most, prompt tokens
    /// that started from a prefix the cache held.
    pub fn cache_use(&self) -> CacheUse {
        self.usage.lock().map_or_else(|poisoned| *poisoned.into_inner(), |u| *u)
    }

    /// Queues a request; its events arrive on the returned receiver, the last one `Event::Done`.
    pub async fn submit(&self, request: Request) -> Result<(RequestId, tmpsc::UnboundedReceiver<Event>), SubmitError> {
        let (events, rx) = tmpsc::unbounded_channel();
        let (reply, answer) = oneshot::channel();
        self.tx.send(Command::Submit { request, events, reply }).map_err(|_| SubmitError::Stopped)?;
        let id = answer.await.map_err(|_| SubmitError::Stopped)??;
        Ok((id, rx))
    }

    pub fn cancel(&self, id: RequestId) {
        let _ = self.tx.send(Command::Cancel(id));
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("the engine has stopped")]
    Stopped,
}

fn serve<B: EmberBackend>(mut engine: Engine<B>, rx: mpsc::Receiver<Command>, usage: &Mutex<CacheUse>) {
    let mut routes: HashMap<RequestId, tmpsc::UnboundedSender<Event>> = HashMap::new();
    let mut logged = engine.cache_use();
    loop {
        if engine.is_idle() {
            let u = engine.cache_use();
            if u != logged {
                tracing::info!(
                    "KV cache: {} blocks of {} positions held, at most {}; {} of {} prompt tokens started from a shared prefix",
                    u.held_blocks,
                    u.block_size,
                    u.peak_blocks,
                    u.reused_tokens,
                    u.prompt_tokens
                );
                logged = u;
            }
            match rx.recv() {
                Ok(command) => handle(&mut engine, &mut routes, command),
                Err(_) => return,
            }
        }
        while let Ok(command) = rx.try_recv() {
            handle(&mut engine, &mut routes, command);
        }
        let events = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.step())) {
            Ok(events) => events,
            Err(_) => {
                // The cache may be half written: every request ends as cancelled (its client gets an
                // error) and the engine starts again from an empty cache.
                tracing::error!("the model panicked in a decoding step; its requests are ended");
                engine.abort_all()
            }
        };
        if let Ok(mut u) = usage.lock() {
            *u = engine.cache_use();
        }
        for event in events {
            let (Event::Token { id, .. } | Event::Done { id, .. }) = event;
            let done = matches!(event, Event::Done { .. });
            let delivered = routes.get(&id).is_some_and(|tx| tx.send(event).is_ok());
            if done || !delivered {
                routes.remove(&id);
                if !done {
                    engine.cancel(id); // the client is gone
                }
            }
        }
    }
}

fn handle<B: EmberBackend>(
    engine: &mut Engine<B>,
    routes: &mut HashMap<RequestId, tmpsc::UnboundedSender<Event>>,
    command: Command,
) {
    match command {
        Command::Submit { request, events, reply } => {
            let submitted = engine.submit(request);
            if let Ok(id) = submitted {
                routes.insert(id, events);
            }
            if let Err(Ok(id)) = reply.send(submitted) {
                // The client left before hearing back.
                routes.remove(&id);
                engine.cancel(id);
            }
        }
        Command::Cancel(id) => {
            routes.remove(&id);
            engine.cancel(id);
        }
    }
}
