//! What the chat sees while a task runs, before its answer: the platform's typing
//! indicator (`Typing`), and on platforms that can edit a sent message a placeholder that
//! becomes the answer, edited with the streamed text as it comes (`Feedback`); on platforms
//! that take progress lines instead (the generic channel with `progress = true`), the
//! streamed text so far as numbered progress revisions; on the console, the streamed text
//! so far, which its page polls.
//!
//! Exactly one message per question holds through crashes because the placeholder is an
//! outbox row under the run's reply key (`Store::queue_placeholder`): the outbox sends it
//! and records its message id, and the task's answer takes over the same row
//! (`reply_upsert!`), so it is delivered by editing that message. A run resumed after a
//! crash finds the row taken and edits the same message. The edits of streamed text are
//! best effort and go straight to the platform; they stop (and the one in flight is awaited)
//! before the answer is committed, so none can land after the answer's edit.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::channels::platform::Delivered;
use crate::domain::{Fence, ReplyRow, ReplyStatus, ReplyType, TaskRow, now_ms, reply_key};
use crate::store::outbox::NewPlaceholder;

use super::worker::Worker;

/// The placeholder and streamed edits of one run.
pub struct Feedback {
    svc: Arc<Worker>,
    fence: Fence,
    key: String,
    channel: String,
    conversation_id: String,
    in_reply_to: String,
    placeholder: String,
    /// How long the run goes before its placeholder is sent.
    after: Duration,
    started: Instant,
    /// The least time between two edits of streamed text; `None`: no streaming.
    stream_every: Option<Duration>,
    /// The platform shows "typing…" meanwhile: the placeholder waits for streamed text.
    typing: bool,
    /// A streamed text past one message goes on in the next parts (`Channels::streams_parts`).
    continues: bool,
    mode: Mode,
    state: Mutex<State>,
}

/// How the text so far is shown.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// In a placeholder message that is edited and becomes the answer.
    Placeholder,
    /// As progress lines (`Platform::progress`) of revisions 1, 2, …, the answer following
    /// as its own reply.
    Progress,
    /// The console: kept for the page to poll.
    Live,
}

/// The longest a progress line may hold up its run: a slow receiver costs at most this, and
/// a failure only a log line.
pub const PROGRESS_WAIT: Duration = Duration::from_secs(2);

#[derive(Default)]
struct State {
    /// The placeholder was queued (by this run, or an earlier run of the task did).
    queued: bool,
    /// The placeholder's platform message id, once known.
    message_id: Option<String>,
    looked_up: Option<Instant>,
    last_edit: Option<Instant>,
    /// The text the chat shows (as far as this run knows).
    shown: String,
    /// The text so far (streamed, or a workflow node's progress line).
    latest: String,
    /// The last progress revision posted (`Mode::Progress`).
    revision: i64,
    /// Parts 2, 3, … of a streamed answer that goes on in its next parts (`streams_parts`):
    /// each one's message id once sent, and the text it shows.
    parts: Vec<(Option<String>, String)>,
    /// A part's send is in doubt: no later part is sent while the answer streams.
    parts_stopped: bool,
    /// The job in flight (one at a time), and whether it must be awaited before the answer
    /// (a queueing or an edit; a lookup is simply stopped).
    busy: Option<(JoinHandle<()>, bool)>,
    /// The answer is about to be committed: nothing more is shown.
    settled: bool,
}

impl Feedback {
    /// The feedback of a run of `task` (answering the platform message `in_reply_to`): on a
    /// platform that can edit, unless the agent's placeholder (`agent_placeholder`, else
    /// `replies.placeholder`) is empty; on one that streams progress lines, or the console,
    /// when answers stream (`replies.stream_edit_ms`).
    pub fn start(
        svc: &Arc<Worker>,
        fence: &Fence,
        task: &TaskRow,
        in_reply_to: &str,
        agent_placeholder: Option<&str>,
    ) -> Option<Arc<Feedback>> {
        let replies = &svc.config.replies;
        let placeholder = agent_placeholder
            .unwrap_or(&replies.placeholder)
            .to_string();
        let mode = if svc.channels.keeps_live_text(&task.channel) {
            Mode::Live
        } else if !placeholder.trim().is_empty() && svc.channels.can_edit(&task.channel) {
            Mode::Placeholder
        } else if svc.channels.streams_progress(&task.channel) {
            Mode::Progress
        } else {
            return None;
        };
        if mode != Mode::Placeholder && replies.stream_edit_ms == 0 {
            return None;
        }
        let typing = typing_every(svc, &task.channel).is_some();
        let feedback = Arc::new(Feedback {
            svc: svc.clone(),
            fence: fence.clone(),
            key: reply_key(task.id, task.resume_count),
            channel: task.channel.clone(),
            conversation_id: task.conversation_id.clone(),
            in_reply_to: in_reply_to.to_string(),
            placeholder,
            after: Duration::from_millis(replies.placeholder_after_ms),
            started: Instant::now(),
            stream_every: (replies.stream_edit_ms > 0)
                .then(|| Duration::from_millis(replies.stream_edit_ms)),
            typing,
            continues: mode == Mode::Placeholder && svc.channels.streams_parts(&task.channel),
            mode,
            state: Mutex::new(State::default()),
        });
        Some(feedback)
    }

    /// Sends the placeholder once `placeholder_after_ms` has passed, unless the platform
    /// shows typing (then streamed text brings it). Abort the handle when the run ends.
    pub fn timer(self: &Arc<Self>) -> Option<JoinHandle<()>> {
        if self.typing || self.mode != Mode::Placeholder {
            return None;
        }
        let me = self.clone();
        Some(tokio::spawn(
            async move {
                tokio::time::sleep(me.after).await;
                me.poke();
            }
            .in_current_span(),
        ))
    }

    /// Whether model calls should stream their answer here.
    pub fn streams(&self) -> bool {
        self.stream_every.is_some()
    }

    /// Whether a workflow node's progress line is shown here (in the placeholder, or on
    /// the console); where the text so far goes as progress lines, the node's line is
    /// posted as one by the node itself.
    pub fn shows_progress_lines(&self) -> bool {
        self.mode != Mode::Progress
    }

    /// The answer so far (or a progress line): shown when the pace allows.
    pub fn show(self: &Arc<Self>, text: &str) {
        if self.mode == Mode::Live {
            // Forgotten when the run's feedback goes (`Drop`).
            self.svc
                .channels
                .keep_live_text(&self.channel, self.fence.task_id, Some(text));
            return;
        }
        // A message holds only so much: past the platform's limit, the message shows the
        // answer's first part, and the rest goes on in the next parts where the platform
        // can edit them (`streams_parts`), else follows as the answer's next parts.
        let text = if self.continues {
            text.to_string()
        } else {
            self.svc.channels.streamed_view(&self.channel, text)
        };
        self.lock().latest = text;
        self.poke();
    }

    /// Stops showing anything and waits for the queueing or edit in flight, so that the
    /// answer, committed next, is the last thing the chat shows.
    pub async fn settle(&self) {
        let busy = {
            let mut state = self.lock();
            state.settled = true;
            state.busy.take()
        };
        match busy {
            Some((busy, true)) => {
                let wait = Duration::from_secs(self.svc.config.outbox.timeout_secs.max(1));
                if tokio::time::timeout(wait, busy).await.is_err() {
                    tracing::warn!(key = %self.key, "a streamed edit did not end in time");
                }
            }
            Some((lookup, false)) => lookup.abort(),
            None => {}
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Does the next thing due, if nothing is in flight: queue the placeholder, find its
    /// message id, or edit it to the latest text.
    fn poke(self: &Arc<Self>) {
        let mut state = self.lock();
        if state.settled || state.busy.as_ref().is_some_and(|(b, _)| !b.is_finished()) {
            return;
        }
        let now = Instant::now();
        let job = if self.mode == Mode::Progress {
            let every = self.stream_every.unwrap_or_default();
            if state.latest == state.shown || state.last_edit.is_some_and(|t| now - t < every) {
                return;
            }
            state.last_edit = Some(now);
            state.shown = state.latest.clone();
            state.revision += 1;
            Job::Progress(state.revision, state.latest.clone())
        } else {
            match self.placeholder_job(&mut state, now) {
                Some(job) => job,
                None => return,
            }
        };
        let me = self.clone();
        let awaited = !matches!(job, Job::Find);
        let handle = tokio::spawn(
            async move {
                me.run(job).await;
                // Whatever came meanwhile (more text, a progress line) is due next.
                me.lock().busy = None;
                me.poke();
            }
            .in_current_span(),
        );
        state.busy = Some((handle, awaited));
    }

    /// The next thing due for the placeholder: queue it, find its message id, edit it, or
    /// send or edit the next parts of a text that outgrew it.
    fn placeholder_job(&self, state: &mut State, now: Instant) -> Option<Job> {
        let pieces = if self.continues {
            self.svc
                .channels
                .streamed_pieces(&self.channel, &state.latest)
        } else {
            vec![state.latest.clone()]
        };
        let first = pieces.first().cloned().unwrap_or_default();
        if !state.queued {
            let due = now.duration_since(self.started) >= self.after;
            if !due || (self.typing && state.latest.is_empty()) {
                return None;
            }
            state.queued = true;
            let text = if first.is_empty() {
                self.placeholder.clone()
            } else {
                first
            };
            state.shown = text.clone();
            return Some(Job::Queue(text));
        }
        let every = self.stream_every?;
        if state.last_edit.is_some_and(|t| now - t < every) {
            return None;
        }
        let Some(id) = state.message_id.clone() else {
            // The placeholder is being sent: its id, before anything is shown in it.
            if first == state.shown || state.looked_up.is_some_and(|t| now - t < every) {
                return None;
            }
            state.looked_up = Some(now);
            return Some(Job::Find);
        };
        if first != state.shown {
            state.last_edit = Some(now);
            state.shown = first.clone();
            return Some(Job::Edit(id, first));
        }
        // The first part shows its final text: the next part that shows less than its
        // piece is sent, or edited.
        if state.parts_stopped {
            return None;
        }
        let (k, piece) = pieces.into_iter().enumerate().skip(1).find(|(k, piece)| {
            state
                .parts
                .get(k - 1)
                .is_none_or(|(_, shown)| shown != piece)
        })?;
        if state.parts.len() < k {
            state.parts.resize(k, (None, String::new()));
        }
        let part = &mut state.parts[k - 1];
        part.1 = piece.clone();
        state.last_edit = Some(now);
        Some(match part.0.clone() {
            Some(id) => Job::EditPart(k + 1, id, piece),
            None => Job::SendPart(k + 1, piece),
        })
    }

    async fn run(self: &Arc<Self>, job: Job) {
        let svc = &self.svc;
        match job {
            Job::Queue(text) => {
                let content = serde_json::json!({ "text": text }).to_string();
                let placeholder = NewPlaceholder {
                    key: &self.key,
                    channel: &self.channel,
                    conversation_id: &self.conversation_id,
                    in_reply_to: &self.in_reply_to,
                    content: &content,
                };
                match svc
                    .store
                    .queue_placeholder(&self.fence, &placeholder, now_ms())
                    .await
                {
                    Ok(true) => {
                        tracing::info!(key = %self.key, "placeholder queued");
                        svc.wake.replies.notify_one();
                    }
                    // The key is taken: an earlier run's placeholder (edited below) or the
                    // answer; or the run lost its task.
                    Ok(false) => {}
                    Err(e) => tracing::warn!(error = %e, "queueing the placeholder failed"),
                }
            }
            Job::Find => match svc
                .store
                .placeholder_message(self.fence.task_id, &self.key)
                .await
            {
                Ok(Some(id)) => self.lock().message_id = Some(id),
                // Not sent yet: look again a little later (the answer stops this).
                Ok(None) => tokio::time::sleep(self.stream_every.unwrap_or_default()).await,
                Err(e) => tracing::debug!(error = %e, "placeholder lookup failed"),
            },
            Job::Edit(message_id, text) => {
                if svc
                    .channels
                    .admit(&self.channel, &self.conversation_id, now_ms())
                    .is_err()
                {
                    // The chat's pace is used up: the next text tries again.
                    self.lock().shown.clear();
                    return;
                }
                let edit = self.partial_reply(message_id, text);
                if let Err(e) = svc.channels.edit(&edit).await {
                    tracing::debug!(error = %e, "streamed edit not shown");
                }
            }
            Job::SendPart(part, text) => self.send_part(part, text).await,
            Job::EditPart(part, message_id, text) => {
                if svc
                    .channels
                    .admit(&self.channel, &self.conversation_id, now_ms())
                    .is_err()
                {
                    self.forget_part_shown(part);
                    return;
                }
                let mut edit = self.partial_reply(message_id, text);
                edit.idempotency_key = format!("{}-part-{part}", self.key);
                if let Err(e) = svc.channels.edit(&edit).await {
                    tracing::debug!(part, error = %e, "streamed edit of a part not shown");
                }
            }
            Job::Progress(revision, text) => {
                let update = crate::channels::platform::Progress {
                    key: format!("{}-progress-{revision}", self.key),
                    task_id: self.fence.task_id,
                    conversation_id: self.conversation_id.clone(),
                    in_reply_to: self.in_reply_to.clone(),
                    revision,
                    text,
                };
                let sent = svc.channels.progress(&self.channel, &update);
                match tokio::time::timeout(PROGRESS_WAIT, sent).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::debug!(revision, error = %e, "progress not shown"),
                    Err(_) => tracing::debug!(revision, "progress not shown in time"),
                }
            }
        }
    }

    /// Sends part `part` (≥ 2) of a streamed answer under its key `<key>-part-<part>`,
    /// recording on the placeholder's row first that it is going (`StreamedPart::Sending`),
    /// then its message id, for the answer to edit. A part whose id was not recorded (a
    /// crash, a lost answer, a failed send) is in doubt: the answer's delivery sends it once
    /// more as a retry, which the platform drops as a repeat (Matrix, Lark) or finds by its
    /// key (Slack), and gives the answer up as UNKNOWN where a resend is blind (Telegram,
    /// DingTalk). A failed send stops the stream's later parts, unless the platform said it
    /// was not sent.
    async fn send_part(&self, part: usize, text: String) {
        use crate::store::outbox::{Noted, StreamedPart};
        let svc = &self.svc;
        if svc
            .channels
            .admit(&self.channel, &self.conversation_id, now_ms())
            .is_err()
        {
            self.forget_part_shown(part);
            return;
        }
        let note = |state| {
            svc.store
                .note_streamed_part(&self.fence, &self.key, part, state)
        };
        let blind = svc.channels.resend_is_blind(&self.channel);
        let mut reply = self.partial_reply(String::new(), text);
        match note(StreamedPart::Sending).await {
            Ok(Noted::Recorded) => {}
            // An earlier run of the task (before a crash) showed it: edited from now on.
            Ok(Noted::WasShown(id)) => {
                if let Some(slot) = self.lock().parts.get_mut(part - 2) {
                    *slot = (Some(id), String::new());
                }
                return;
            }
            // An earlier run's send is in doubt: settled by the answer's delivery where a
            // resend is blind; elsewhere sent again as a retry (found or dropped by key).
            Ok(Noted::WasInDoubt) if blind => {
                self.lock().parts_stopped = true;
                return;
            }
            Ok(Noted::WasInDoubt) => reply.attempts = 2,
            Ok(Noted::RunEnded) => {
                return tracing::debug!(part, "streamed part not sent: the run ended");
            }
            Err(e) => {
                self.forget_part_shown(part);
                return tracing::warn!(part, error = %e, "recording a streamed part failed");
            }
        }
        reply.idempotency_key = format!("{}-part-{part}", self.key);
        reply.edit = false;
        reply.platform_message_id = None;
        // Sent as a placeholder is (on Lark a card, the kind of message that can be edited).
        reply.placeholder = true;
        let recorded = match svc.channels.send(&reply).await {
            Ok(Delivered {
                platform_message_id: Some(id),
            }) => {
                if let Some(slot) = self.lock().parts.get_mut(part - 2) {
                    slot.0 = Some(id.clone());
                }
                note(StreamedPart::Shown(&id)).await
            }
            Ok(Delivered {
                platform_message_id: None,
            }) => {
                self.lock().parts_stopped = true;
                return tracing::warn!(part, "a streamed part was sent without an id");
            }
            // Refused where a resend would be blind: recorded as not sent (else the answer
            // would be given up as in doubt), and due again with the next text.
            Err(e) if !e.unknown && blind => {
                tracing::debug!(part, error = %e, "streamed part not sent");
                self.forget_part_shown(part);
                note(StreamedPart::NotSent).await
            }
            // Perhaps sent: the answer's delivery settles it (finds it by its key where the
            // platform can, else gives the answer up as unknown); no more parts go meanwhile.
            Err(e) => {
                self.lock().parts_stopped = true;
                return tracing::warn!(part, error = %e, "a streamed part may have been sent");
            }
        };
        match recorded {
            Ok(Noted::RunEnded) => {
                tracing::debug!(part, "streamed part not recorded: the run ended")
            }
            Ok(_) => tracing::info!(key = %reply.idempotency_key, "streamed part recorded"),
            Err(e) => tracing::warn!(part, error = %e, "recording a streamed part failed"),
        }
    }

    /// Part `part` was not shown after all: it is due again with the next text.
    fn forget_part_shown(&self, part: usize) {
        if let Some(slot) = self.lock().parts.get_mut(part - 2) {
            slot.1.clear();
        }
    }

    /// A streamed edit as the platform's `edit` takes it.
    fn partial_reply(&self, message_id: String, text: String) -> ReplyRow {
        ReplyRow {
            id: 0,
            task_id: self.fence.task_id,
            idempotency_key: self.key.clone(),
            channel: self.channel.clone(),
            conversation_id: self.conversation_id.clone(),
            in_reply_to: self.in_reply_to.clone(),
            reply_type: ReplyType::Text,
            content: serde_json::json!({ "text": text }).to_string(),
            status: ReplyStatus::Pending,
            platform_message_id: Some(message_id),
            attempts: 1,
            next_attempt_at: 0,
            last_error: None,
            created_at: 0,
            sent_at: None,
            placeholder: false,
            edit: true,
            send_key: None,
            parts_sent: 0,
            streamed_parts: None,
            reply_context: None,
        }
    }
}

impl Drop for Feedback {
    /// The run is over: a kept live text goes (the answer is in the outbox now).
    fn drop(&mut self) {
        if self.mode == Mode::Live {
            self.svc
                .channels
                .keep_live_text(&self.channel, self.fence.task_id, None);
        }
    }
}

enum Job {
    /// Queue the placeholder with this text.
    Queue(String),
    /// Look up the placeholder's message id.
    Find,
    /// Edit the placeholder to this text.
    Edit(String, String),
    /// Post the text so far as this progress revision.
    Progress(i64, String),
    /// Send part k (≥ 2) of a streamed text, with this text.
    SendPart(usize, String),
    /// Edit part k's message to this text.
    EditPart(usize, String, String),
}

/// How often the typing indicator of `channel` is renewed, when it is shown at all
/// (`replies.typing_indicator` and a platform that has one).
fn typing_every(svc: &Worker, channel: &str) -> Option<Duration> {
    if !svc.config.replies.typing_indicator {
        return None;
    }
    svc.channels.typing_every(channel)
}

/// The typing indicator shown in the task's chat while this run lasts.
pub struct Typing {
    shown: JoinHandle<()>,
    svc: Arc<Worker>,
    channel: String,
    conversation_id: String,
}

impl Typing {
    /// Starts showing "typing…" in the task's chat, renewed as the platform needs, when
    /// `replies.typing_indicator` is on and the platform has one.
    pub fn start(svc: &Arc<Worker>, task: &TaskRow) -> Option<Typing> {
        let every = typing_every(svc, &task.channel)?;
        let (channel, conversation_id) = (task.channel.clone(), task.conversation_id.clone());
        let shown = tokio::spawn({
            let (svc, channel, conversation_id) =
                (svc.clone(), channel.clone(), conversation_id.clone());
            async move {
                loop {
                    if let Err(e) = svc.channels.typing(&channel, &conversation_id, true).await {
                        tracing::debug!(error = %e, "typing indicator not shown");
                    }
                    tokio::time::sleep(every).await;
                }
            }
            .in_current_span()
        });
        Some(Typing {
            shown,
            svc: svc.clone(),
            channel,
            conversation_id,
        })
    }

    /// Stops renewing and clears the indicator (where the platform can), bounded by
    /// `outbox.timeout_secs`.
    pub async fn end(self) {
        self.shown.abort();
        let limit = Duration::from_secs(self.svc.config.outbox.timeout_secs.max(1));
        let clear = self
            .svc
            .channels
            .typing(&self.channel, &self.conversation_id, false);
        match tokio::time::timeout(limit, clear).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::debug!(error = %e, "typing indicator not cleared"),
            Err(_) => tracing::debug!("clearing the typing indicator timed out"),
        }
    }
}
