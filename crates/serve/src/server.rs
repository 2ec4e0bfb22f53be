//! The HTTP side: OpenAI's `/v1/completions`, `/v1/chat/completions` (streamed as server-sent
//! events with `stream: true`) and `/v1/models`, and a chat page at `/`.
//!
//! Hardening: the shell ([`ember_http`]) gives it threads of its own, capped request heads, at most
//! [`Limits::max_connections`] connections (503 past it; kept however long an answer waits on the
//! model), bodies announced over [`Limits::max_body`] refused (413) and a `Host` allow-list against
//! DNS rebinding; bodies are read within [`Limits::body_timeout`] (408), an optional API key is
//! required (`Authorization: Bearer …`; the chat page itself is served without it and asks for
//! it), and a full queue is 429. A POST must be JSON (`Content-Type: application/json`, else 415)
//! and, when a browser sends an `Origin`, come from this server's own page (else 403): a web page
//! elsewhere cannot make the user's browser run generations. A client that disconnects
//! mid-answer has its request cancelled at the next token. [`Server::drain`] stops gracefully.
//!
//! Every request is logged (target `ember_serve`): method, route, status, milliseconds and, for
//! generations, the token counts; never the prompt or the answer.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ember_data::finetune::ChatTemplate;
use ember_data::stream::TextStream;
use ember_data::Tokenizer;
use ember_generate::engine::{EngineError, Event, Finish, Request as EngineRequest};
use ember_generate::sample::Sampler;
use ember_http::{race, Conn, Drained, Either, Limits, Priority, Refused, Service, Settings, StartError, Working};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Bytes, Frame, Incoming, SizeHint};
use hyper::header::{HeaderValue, AUTHORIZATION, CACHE_CONTROL, CONTENT_TYPE, HOST, ORIGIN, RETRY_AFTER};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};

use crate::api::{error_body, ChatRequest, CompletionRequest, Generation, Invalid, Kind, Usage};
use crate::chat::ChatPrompt;
use crate::worker::{SubmitError, Worker};

const CHAT_PAGE: &str = include_str!("../assets/chat.html");

/// What the server answers with and how.
pub struct Options {
    /// The name `/v1/models` lists and requests may give as `model`.
    pub model_name: String,
    pub tokenizer: Tokenizer,
    /// For `/v1/chat/completions`; without one, chat requests get 400. A template without a system
    /// turn gets system messages at the head of the next user message ([`crate::chat`]).
    pub template: Option<ChatTemplate>,
    /// The model's context (prompt and answer together).
    pub context: usize,
    /// The sampling of requests that set none (`temperature`, `top_p` left out): the model's chat
    /// defaults ([`crate::sampling::ChatDefaults`]).
    pub sampling: ember_generate::sample::SamplingConfig,
    /// `Host` names answered besides localhost and the address a connection came in on.
    pub allowed_hosts: Vec<String>,
    /// Required as `Authorization: Bearer KEY` when set.
    pub api_key: Option<String>,
    pub limits: Limits,
}

/// A running server; dropping it stops accepting connections.
pub struct Server(ember_http::Server);

impl Server {
    /// Serves on `addr` (port 0: any free port) with the engine behind `worker`. Returns once listening.
    pub fn start(addr: SocketAddr, worker: Worker, mut options: Options) -> Result<Self, StartError> {
        let settings = Settings {
            name: "ember-serve",
            threads: 2,
            priority: Priority::Normal,
            allowed_hosts: options.allowed_hosts.clone(),
            limits: options.limits.clone(),
        };
        let chat = options.template.take().map(ChatPrompt::new);
        if chat.as_ref().is_some_and(|c| !c.renders_system()) {
            tracing::warn!(
                "the model's chat template renders no system message: a request's system messages are put at the \
                 head of the next user message (as llama.cpp's server does)"
            );
        }
        let state = State { worker, options, chat, next_id: AtomicU64::new(1), cut: watch::channel(false).0 };
        ember_http::Server::start(addr, settings, state).map(Self)
    }

    /// Stops gracefully (see [`ember_http::Server::drain`]): answers in work get `grace` to
    /// finish; the rest end with a last event (streams) or 503 (whole answers) naming the
    /// shutdown.
    pub fn drain(self, grace: Duration) -> Drained {
        self.0.drain(grace)
    }

    pub fn addr(&self) -> SocketAddr {
        self.0.addr()
    }

    /// Serves until the process ends.
    pub fn wait(self) {
        self.0.wait()
    }
}

struct State {
    worker: Worker,
    /// Its `template` taken into `chat`.
    options: Options,
    chat: Option<ChatPrompt>,
    next_id: AtomicU64,
    /// Set when the answers in work are to end now (a drain's grace period is over).
    cut: watch::Sender<bool>,
}

impl State {
    /// Resolves when the answers in work are to end ([`Service::cut`]); owns what it waits on, so
    /// that a streamed answer's task can hold it.
    fn cut_signal(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.cut.subscribe();
        async move {
            let _ = rx.wait_for(|&cut| cut).await;
        }
    }
}

impl Service for State {
    type Body = AnswerBody;

    fn refuse(&self, why: Refused) -> Answer {
        match why {
            Refused::Host(host) => {
                let message = format!("Host `{host}` is not served");
                error(StatusCode::FORBIDDEN, "invalid_request_error", &message, None, None)
            }
            Refused::BodyTooLarge(limit) => {
                let message = format!("the body is larger than {limit} bytes");
                error(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", &message, None, None)
            }
            Refused::ShuttingDown => shutting_down(),
        }
    }

    async fn answer(self: Arc<Self>, request: Request<Incoming>, conn: Arc<Conn>) -> Answer {
        let (method, path) = (request.method().clone(), request.uri().path().to_string());
        let start = Instant::now();
        let answer = route(&self, request, &conn).await;
        let ms = start.elapsed().as_millis();
        let status = answer.status().as_u16();
        match answer.extensions().get::<Logged>() {
            Some(Logged::Usage(u)) => tracing::info!(
                "{method} {path} {status} in {ms} ms: {} prompt + {} completion tokens",
                u.prompt_tokens,
                u.completion_tokens
            ),
            Some(Logged::Stream(id)) => tracing::info!("{method} {path} {status} in {ms} ms: streaming {id}"),
            None => tracing::info!("{method} {path} {status} in {ms} ms"),
        }
        answer
    }

    fn cut(&self) {
        self.cut.send_replace(true);
    }
}

/// What the request log adds to an answer's line.
#[derive(Debug, Clone)]
enum Logged {
    Usage(Usage),
    /// A streamed answer's id; its stream logs its own end.
    Stream(String),
}

/// The answer to a request the server cannot finish because it is stopping.
fn shutting_down() -> Answer {
    error(StatusCode::SERVICE_UNAVAILABLE, "server_error", SHUTTING_DOWN, None, Some("server_shutdown"))
}

const SHUTTING_DOWN: &str = "the server is shutting down";

type Answer = Response<AnswerBody>;

/// A whole body, or the server-sent events of a streamed answer as they come (its connection
/// marked as working until the body ends).
pub enum AnswerBody {
    Full(Full<Bytes>),
    Events(mpsc::Receiver<Bytes>, Working),
}

impl Body for AnswerBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            Self::Full(full) => Pin::new(full).poll_frame(cx),
            Self::Events(rx, _) => rx.poll_recv(cx).map(|chunk| chunk.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Full(full) => full.size_hint(),
            Self::Events(..) => SizeHint::default(),
        }
    }
}

fn json_answer(status: StatusCode, body: &Value) -> Answer {
    let mut r = Response::new(AnswerBody::Full(Full::new(Bytes::from(body.to_string()))));
    *r.status_mut() = status;
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

fn error(status: StatusCode, kind: &str, message: &str, param: Option<&str>, code: Option<&str>) -> Answer {
    json_answer(status, &error_body(kind, message, param, code))
}

fn invalid(e: Invalid) -> Answer {
    if e.param == "model" {
        // As OpenAI answers a model it does not have.
        return error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            &e.message,
            Some("model"),
            Some("model_not_found"),
        );
    }
    error(StatusCode::BAD_REQUEST, "invalid_request_error", &e.message, Some(&e.param), None)
}

/// Why a POST is refused before its body is read: a cross-origin browser request (403) or a body
/// that is not declared JSON (415).
fn refuse_post(req: &Request<Incoming>) -> Option<Answer> {
    let headers = req.headers();
    if let Some(origin) = headers.get(ORIGIN) {
        // A browser names the page that sent the request; only this server's own page may.
        let host = headers.get(HOST).and_then(|h| h.to_str().ok()).unwrap_or_default();
        let origin = origin.to_str().unwrap_or("(not text)");
        if origin != format!("http://{host}") {
            let message = format!(
                "cross-origin requests are refused: Origin `{origin}` is not this server's page (http://{host})"
            );
            return Some(error(StatusCode::FORBIDDEN, "invalid_request_error", &message, None, Some("cross_origin")));
        }
    }
    let content_type = headers.get(CONTENT_TYPE).map(|h| h.to_str().unwrap_or("(not text)"));
    let media = content_type.map(|c| c.split(';').next().unwrap_or_default().trim().to_ascii_lowercase());
    if media.as_deref() != Some("application/json") {
        let message = format!(
            "the body must be JSON sent as `Content-Type: application/json`; got {}",
            content_type.map_or_else(|| "no Content-Type".to_string(), |c| format!("`{c}`"))
        );
        let code = Some("unsupported_media_type");
        return Some(error(StatusCode::UNSUPPORTED_MEDIA_TYPE, "invalid_request_error", &message, None, code));
    }
    None
}

async fn route(state: &State, req: Request<Incoming>, conn: &Arc<Conn>) -> Answer {
    let path = req.uri().path().to_string();
    // The chat page holds no secret: it is served to anyone who reaches the server, and asks its
    // user for the key.
    let page = req.method() == Method::GET && path == "/";
    if let (Some(key), false) = (&state.options.api_key, page) {
        let given =
            req.headers().get(AUTHORIZATION).and_then(|h| h.to_str().ok()).and_then(|h| h.strip_prefix("Bearer "));
        if given != Some(key.as_str()) {
            let message = "a valid API key is required (Authorization: Bearer KEY)";
            return error(StatusCode::UNAUTHORIZED, "invalid_request_error", message, None, Some("invalid_api_key"));
        }
    }
    if req.method() == Method::POST {
        if let Some(refused) = refuse_post(&req) {
            return refused;
        }
    }
    match (req.method().clone(), path.as_str()) {
        (Method::GET, "/") => {
            let mut r = Response::new(AnswerBody::Full(Full::new(Bytes::from_static(CHAT_PAGE.as_bytes()))));
            r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8"));
            r
        }
        (Method::GET, "/v1/models") => {
            let model = json!({"id": state.options.model_name, "object": "model", "created": 0, "owned_by": "ember"});
            json_answer(StatusCode::OK, &json!({"object": "list", "data": [model]}))
        }
        (Method::GET, "/health") => {
            let u = state.worker.cache_use();
            let cache = json!({
                "block_size": u.block_size,
                "held_blocks": u.held_blocks,
                "peak_blocks": u.peak_blocks,
                "prompt_tokens": u.prompt_tokens,
                "reused_prompt_tokens": u.reused_tokens,
            });
            json_answer(StatusCode::OK, &json!({"status": "ok", "kv_cache": cache}))
        }
        (Method::POST, "/v1/completions") => match read_json::<CompletionRequest>(state, req).await {
            Ok(r) => completion(state, r, conn).await,
            Err(answer) => answer,
        },
        (Method::POST, "/v1/chat/completions") => match read_json::<ChatRequest>(state, req).await {
            Ok(r) => chat(state, r, conn).await,
            Err(answer) => answer,
        },
        (_, "/v1/completions" | "/v1/chat/completions" | "/v1/models" | "/" | "/health") => {
            error(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "method not allowed", None, None)
        }
        _ => error(StatusCode::NOT_FOUND, "invalid_request_error", &format!("no such endpoint: {path}"), None, None),
    }
}

/// The body as JSON read into a `T`, within the size and time limits (a body announced over the
/// size limit never gets here: the shell refuses it). Bad JSON is refused with the parser's
/// message; a field of the wrong type with a message naming it and what it should be, as `param`.
async fn read_json<T: TryFrom<Value, Error = Invalid>>(state: &State, req: Request<Incoming>) -> Result<T, Answer> {
    let limits = &state.options.limits;
    let body = Limited::new(req.into_body(), usize::try_from(limits.max_body).unwrap_or(usize::MAX));
    let bytes = match tokio::time::timeout(limits.body_timeout, body.collect()).await {
        Err(_) => {
            return Err(error(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                "the body did not arrive in time",
                None,
                None,
            ))
        }
        Ok(Err(_)) => return Err(state.refuse(Refused::BodyTooLarge(limits.max_body))),
        Ok(Ok(collected)) => collected.to_bytes(),
    };
    let body: Value = serde_json::from_slice(&bytes).map_err(|e| {
        let message = format!("could not parse the JSON body: {e}");
        error(StatusCode::BAD_REQUEST, "invalid_request_error", &message, None, None)
    })?;
    T::try_from(body).map_err(|e| {
        // An empty param is the body as a whole.
        let param = Some(e.param.as_str()).filter(|p| !p.is_empty());
        error(StatusCode::BAD_REQUEST, "invalid_request_error", &e.message, param, None)
    })
}

/// New tokens of a completion whose request names no `max_tokens`, as OpenAI's default.
pub const COMPLETION_MAX_TOKENS: usize = 16;

async fn completion(state: &State, r: CompletionRequest, conn: &Arc<Conn>) -> Answer {
    let prepared = (|| {
        let prompt = r.prompt()?;
        let mut generation = r.settings.generation(&state.options.model_name, &state.options.sampling)?;
        generation.max_tokens.get_or_insert(COMPLETION_MAX_TOKENS);
        let ids = state.options.tokenizer.encode_prompt(prompt).map_err(|e| Invalid::new("prompt", e.to_string()))?;
        Ok::<_, Invalid>((ids, generation))
    })();
    match prepared {
        Ok((ids, generation)) => run(state, Kind::Completion, ids, generation, conn).await,
        Err(e) => invalid(e),
    }
}

async fn chat(state: &State, r: ChatRequest, conn: &Arc<Conn>) -> Answer {
    let Some(template) = &state.chat else {
        return invalid(Invalid::new("messages", "this model has no chat template; use /v1/completions"));
    };
    let prepared = (|| {
        let generation = r.settings.generation(&state.options.model_name, &state.options.sampling)?;
        let messages = r.messages(template.roles())?;
        let text = template.render(&messages)?;
        let ids = state.options.tokenizer.encode_prompt(&text).map_err(|e| Invalid::new("messages", e.to_string()))?;
        Ok::<_, Invalid>((ids, generation))
    })();
    match prepared {
        Ok((ids, generation)) => run(state, Kind::Chat, ids, generation, conn).await,
        Err(e) => invalid(e),
    }
}

/// Runs a checked request on the engine and answers it, whole or streamed.
async fn run(state: &State, kind: Kind, prompt: Vec<u32>, g: Generation, conn: &Arc<Conn>) -> Answer {
    let context = state.options.context;
    let max_new_tokens = g.max_tokens.unwrap_or(context.saturating_sub(prompt.len()).max(1));
    let seed =
        g.seed.unwrap_or_else(|| SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64));
    let sampler = match Sampler::new(g.sampling.clone(), seed) {
        Ok(s) => s,
        Err(e) => return invalid(Invalid::new("temperature", e.to_string())),
    };
    let ends = if g.ignore_eos { Vec::new() } else { state.options.tokenizer.end_ids() };
    let request = EngineRequest { prompt: prompt.clone(), max_new_tokens, stop_tokens: ends.clone(), sampler };
    let (id, events) = match state.worker.submit(request).await {
        Ok(submitted) => submitted,
        Err(e) => return refused(e),
    };
    let n = state.next_id.fetch_add(1, Ordering::Relaxed);
    let answer = Answering {
        kind,
        id: format!("{}-{n}", if kind == Kind::Chat { "chatcmpl" } else { "cmpl" }),
        created: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        model: state.options.model_name.clone(),
        prompt_tokens: prompt.len(),
    };
    let pending = Pending {
        tokenizer: state.options.tokenizer.clone(),
        prompt,
        stops: g.stop,
        ends,
        events,
        worker: state.worker.clone(),
        id,
    };
    if !g.stream {
        let collected = race(collect(pending), state.cut_signal()).await;
        return match collected {
            Either::Left(Ok((text, finish, usage))) => {
                let mut r = json_answer(
                    StatusCode::OK,
                    &kind.response(&answer.id, answer.created, &answer.model, &text, finish, usage),
                );
                r.extensions_mut().insert(Logged::Usage(usage));
                r
            }
            Either::Left(Err(())) => {
                error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", ENGINE_FAILED, None, None)
            }
            Either::Right(()) => shutting_down(),
        };
    }
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    let (id, cut) = (answer.id.clone(), state.cut_signal());
    tokio::spawn(answer.stream(pending, tx, cut));
    let mut r = Response::new(AnswerBody::Events(rx, conn.working()));
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    r.headers_mut().insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r.extensions_mut().insert(Logged::Stream(id));
    r
}

fn refused(e: SubmitError) -> Answer {
    match e {
        SubmitError::Engine(EngineError::QueueFull(n)) => {
            let message = format!("the server is busy: {n} requests are waiting; retry later");
            let mut r = error(StatusCode::TOO_MANY_REQUESTS, "server_busy", &message, None, Some("queue_full"));
            r.headers_mut().insert(RETRY_AFTER, HeaderValue::from_static("1"));
            r
        }
        SubmitError::Engine(e @ EngineError::TooLong { .. }) => error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            &e.to_string(),
            Some("max_tokens"),
            Some("context_length_exceeded"),
        ),
        SubmitError::Engine(e @ EngineError::Prompt(_)) => {
            error(StatusCode::BAD_REQUEST, "invalid_request_error", &e.to_string(), Some("prompt"), None)
        }
        SubmitError::Stopped => {
            error(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the engine has stopped", None, None)
        }
    }
}

/// What the server says when the engine ended a request itself (a failed decoding step).
const ENGINE_FAILED: &str = "the model failed while decoding this request; it was ended";

/// The next piece of text of a request, and whether it is over (with OpenAI's finish reason and
/// the engine's token count). `Err` when the engine ended it (a failed step) or is gone.
async fn next_piece(
    text: &mut TextStream<'_>,
    events: &mut mpsc::UnboundedReceiver<Event>,
    generated: &mut usize,
) -> Result<(String, Option<&'static str>), ()> {
    match events.recv().await {
        Some(Event::Token { token, .. }) => {
            *generated += 1;
            let (piece, stopped) = text.push(token);
            Ok((piece, stopped.then_some("stop")))
        }
        Some(Event::Done { finish: Finish::Cancelled, .. }) | None => Err(()),
        Some(Event::Done { finish, completion_tokens, .. }) => {
            *generated = completion_tokens;
            let reason = if finish == Finish::Length { "length" } else { "stop" };
            Ok((text.finish(), Some(reason)))
        }
    }
}

/// A request on the engine and what turning its tokens into text needs.
struct Pending {
    tokenizer: Tokenizer,
    prompt: Vec<u32>,
    stops: Vec<String>,
    ends: Vec<u32>,
    events: mpsc::UnboundedReceiver<Event>,
    worker: Worker,
    id: u64,
}

async fn collect(p: Pending) -> Result<(String, &'static str, Usage), ()> {
    let Pending { tokenizer, prompt, stops, ends, mut events, worker, id } = p;
    // Dropped with this future when the client disconnects (hyper drops the request's future).
    let _cancel = CancelOnDrop { worker: &worker, id };
    let mut text = TextStream::new(&tokenizer, &prompt, stops, &ends);
    let (mut out, mut generated) = (String::new(), 0);
    loop {
        let (piece, finish) = next_piece(&mut text, &mut events, &mut generated).await?;
        out.push_str(&piece);
        if let Some(finish) = finish {
            return Ok((out, finish, Usage::new(prompt.len(), generated)));
        }
    }
}

/// The JSON framing of one answer.
struct Answering {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    prompt_tokens: usize,
}

impl Answering {
    fn event(&self, text: &str, finish: Option<&str>, usage: Option<Usage>) -> Bytes {
        let chunk = self.kind.chunk(&self.id, self.created, &self.model, text, finish, usage);
        Bytes::from(format!("data: {chunk}\n\n"))
    }

    /// Streams the answer's events into `tx` until it is over, the client leaves or `cut`
    /// resolves (then a last error event says the server is shutting down), and logs how it ended.
    async fn stream(self, p: Pending, tx: mpsc::Sender<Bytes>, cut: impl Future<Output = ()>) {
        let start = Instant::now();
        let mut generated = 0;
        let ended = self.events(p, &tx, cut, &mut generated).await;
        let (id, prompt, ms) = (&self.id, self.prompt_tokens, start.elapsed().as_millis());
        tracing::info!("{id}: {ended} after {ms} ms: {prompt} prompt + {generated} completion tokens");
    }

    async fn events(
        &self,
        p: Pending,
        tx: &mpsc::Sender<Bytes>,
        cut: impl Future<Output = ()>,
        generated: &mut usize,
    ) -> &'static str {
        let Pending { tokenizer, prompt, stops, ends, mut events, worker, id } = p;
        let _cancel = CancelOnDrop { worker: &worker, id };
        let mut text = TextStream::new(&tokenizer, &prompt, stops, &ends);
        let mut cut = std::pin::pin!(cut);
        loop {
            // A client that leaves while its request waits in the queue sends nothing to notice:
            // the body's end going away says so.
            let next = race(next_piece(&mut text, &mut events, generated), race(tx.closed(), cut.as_mut())).await;
            let next = match next {
                Either::Left(next) => next,
                Either::Right(Either::Left(())) => return "the client disconnected",
                Either::Right(Either::Right(())) => {
                    let last = error_body("server_error", SHUTTING_DOWN, None, Some("server_shutdown"));
                    let _ = send_within(tx, Bytes::from(format!("data: {last}\n\n"))).await;
                    let _ = send_within(tx, Bytes::from_static(b"data: [DONE]\n\n")).await;
                    return "ended by the server's shutdown";
                }
            };
            let Ok((piece, finish)) = next else {
                let failed = error_body("server_error", ENGINE_FAILED, None, None);
                let _ = send_within(tx, Bytes::from(format!("data: {failed}\n\n"))).await;
                return "ended by a failed decoding step";
            };
            let sent = match finish {
                None if piece.is_empty() => true,
                None => send_within(tx, self.event(&piece, None, None)).await,
                Some(finish) => {
                    let usage = Usage::new(self.prompt_tokens, *generated);
                    let last = piece.is_empty() || send_within(tx, self.event(&piece, None, None)).await;
                    let _ = last && send_within(tx, self.event("", Some(finish), Some(usage))).await;
                    let _ = send_within(tx, Bytes::from_static(b"data: [DONE]\n\n")).await;
                    return if finish == "length" { "finished (length)" } else { "finished (stop)" };
                }
            };
            if !sent {
                return "the client disconnected";
            }
        }
    }
}

/// Cancels a request when its answer is dropped: over (harmless), or abandoned by its client.
struct CancelOnDrop<'a> {
    worker: &'a Worker,
    id: u64,
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        self.worker.cancel(self.id);
    }
}

/// How long a streamed piece may wait for a client that does not read before the answer (and its
/// request) is given up.
const STALL: Duration = Duration::from_secs(30);

/// Sends one piece of a streamed answer; false when the client is gone or has not taken what was
/// sent before for [`STALL`].
async fn send_within(tx: &mpsc::Sender<Bytes>, piece: Bytes) -> bool {
    matches!(tokio::time::timeout(STALL, tx.send(piece)).await, Ok(Ok(())))
}
