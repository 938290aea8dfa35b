//! A single-turn conversation's history within the model's budget: the newest exchanges in
//! full, the older ones folded into a summary that the conversation's later messages carry
//! over, so that a long conversation does not ask for a summary before every answer
//! (docs/workflows.md, "Long tasks: rolling summaries").

use super::task::{RunError, TaskContext};
use super::worker::Worker;
use crate::llm::{ChatMessage, Role, estimate_tokens};

/// One turn of the conversation: a user's message or the answer to it, with the message's id.
#[derive(Debug, Clone)]
pub(crate) struct Turn {
    pub message_id: i64,
    pub message: ChatMessage,
}

/// How a task's prompt holds its conversation.
#[derive(Debug)]
pub(crate) struct Plan<'a> {
    /// An earlier task's summary of the conversation: its text and the id of the newest
    /// message it covers.
    pub carried: Option<(String, i64)>,
    /// The turns to fold (after `carried`) into a new summary first; none: no summary call.
    pub fold: &'a [Turn],
    /// The turns given in full, the question last.
    pub recent: &'a [Turn],
    /// The turns given in full when the new summary could not be made: the newest that fit
    /// the budget beside the carried summary (at least the question).
    pub unfolded: &'a [Turn],
}

/// The conversation's recent turns up to and including the question (its last
/// `history_messages + 1` messages): the user's messages and, where answered, the answers.
pub(crate) async fn conversation_turns(
    svc: &Worker,
    ctx: &TaskContext,
) -> Result<Vec<Turn>, RunError> {
    let (task, message, agent) = (&ctx.task, &ctx.message, &ctx.agent);
    let read;
    let history = match &ctx.history {
        Some(history) => history,
        None => {
            read = svc
                .store
                .conversation_history(
                    &task.channel,
                    &task.conversation_id,
                    message.id,
                    i64::from(agent.history_messages) + 1,
                )
                .await?;
            &read
        }
    };
    let mut turns = Vec::new();
    for entry in history {
        let turn = |message| Turn {
            message_id: entry.message_id,
            message,
        };
        turns.push(turn(ChatMessage::user(entry.text.clone())));
        if entry.message_id == message.id {
            break;
        }
        if let Some(answer) = &entry.answer {
            turns.push(turn(ChatMessage::assistant(answer.clone())));
        }
    }
    Ok(turns)
}

/// Plans the prompt's history within `budget` tokens: all the turns when they fit; else the
/// newest summary that an earlier message's task among `turns` made
/// ([`crate::store::Store::conversation_summary`]) with the turns since, when those fit beside
/// it; else the older turns are folded into a new summary until the newest take at most
/// `context.recent_after_summary_percent` of the budget (whole exchanges; the question always
/// stays), so that the next messages carry that one over.
pub(crate) async fn plan<'a>(
    svc: &Worker,
    ctx: &TaskContext,
    turns: &'a [Turn],
    budget: usize,
) -> Result<Plan<'a>, RunError> {
    let whole = Plan {
        carried: None,
        fold: &[],
        recent: turns,
        unfolded: turns,
    };
    if newest_within(costs(turns), budget) >= turns.len() {
        return Ok(whole);
    }
    // Only an earlier task's summary (a resumed task finds its own fold in its journal),
    // one of a message in the history window read.
    let window = (
        turns.first().map_or(ctx.message.id, |t| t.message_id),
        ctx.message.id,
    );
    let found = svc
        .store
        .conversation_summary(
            &ctx.task.channel,
            &ctx.task.conversation_id,
            window,
            ctx.task.id,
        )
        .await?;
    // The journalled answer of the step that made it; one unreadable is not carried.
    let carried = found.and_then(|(output, through)| {
        let answer = serde_json::from_str::<crate::llm::ChatResponse>(&output);
        answer.ok().map(|answer| (answer.content, through))
    });
    let kept_percent = svc.config.context.recent_after_summary_percent as usize;
    Ok(split(turns, budget, kept_percent, carried))
}

/// [`plan`]'s choice once the turns are known not to fit and `carried` has been read.
fn split(
    turns: &[Turn],
    budget: usize,
    kept_percent: usize,
    carried: Option<(String, i64)>,
) -> Plan<'_> {
    let (since, room) = match &carried {
        Some((text, through)) => (
            &turns[turns.partition_point(|t| t.message_id <= *through)..],
            budget.saturating_sub(estimate_tokens(&summary_message(text).content)),
        ),
        None => (turns, budget),
    };
    let fitting = newest_within(costs(since), room);
    let unfolded = &since[since.len() - fitting.max(1).min(since.len())..];
    if carried.is_some() && fitting >= since.len() {
        return Plan {
            carried,
            fold: &[],
            recent: since,
            unfolded,
        };
    }
    let kept = (budget.saturating_mul(kept_percent) / 100).min(room);
    // The question (last) always stays.
    let keep = whole_exchanges(since, kept).max(1).min(since.len());
    let (fold, recent) = since.split_at(since.len().saturating_sub(keep));
    Plan {
        carried,
        fold,
        recent,
        unfolded,
    }
}

/// The message that gives the model a summary of the earlier conversation.
pub(crate) fn summary_message(summary: &str) -> ChatMessage {
    ChatMessage::user(format!("Summary of the earlier conversation:\n{summary}"))
}

/// What a summary call is asked: the summary so far (if any) and the turns since, one
/// `role: content` line each; the newest turns that fit in about `room` tokens with the
/// summary so far, so that the call stays inside the model's context window (turns before
/// them are left out); the newest alone over it is cut to fit.
pub(crate) fn summary_request(previous: Option<&str>, fold: &[Turn], room: usize) -> String {
    let head = match previous {
        Some(summary) => format!("Summary so far:\n{summary}\n\nConversation since:\n"),
        None => "Conversation so far:\n".to_string(),
    };
    let room = room.saturating_sub(estimate_tokens(&head));
    let lines: Vec<String> = fold
        .iter()
        .map(|t| format!("{}: {}\n", t.message.role, t.message.content))
        .collect();
    let keep = newest_within(lines.iter().map(|l| estimate_tokens(l)), room);
    let transcript = match (keep, lines.last()) {
        (0, Some(newest)) => {
            // `estimate_tokens` counts a token per three bytes, and four more.
            let cut = crate::domain::truncate(newest, room.saturating_sub(8) * 3);
            format!("{cut}\n")
        }
        _ => lines[lines.len() - keep..].concat(),
    };
    format!("{head}{transcript}")
}

/// How many of the newest `turns` fit in `budget` tokens as whole exchanges: from a user's
/// message on (an answer whose question does not fit goes too).
pub(crate) fn whole_exchanges(turns: &[Turn], budget: usize) -> usize {
    let mut keep = newest_within(costs(turns), budget);
    while keep > 0 && turns[turns.len() - keep].message.role != Role::User {
        keep -= 1;
    }
    keep
}

/// Each turn's cost in tokens, oldest first.
fn costs(turns: &[Turn]) -> impl DoubleEndedIterator<Item = usize> + '_ {
    turns.iter().map(|t| estimate_tokens(&t.message.content))
}

/// How many of the last items (`tokens`, each item's cost, oldest first) fit in `budget`
/// together.
fn newest_within(tokens: impl DoubleEndedIterator<Item = usize>, budget: usize) -> usize {
    let mut used = 0usize;
    tokens
        .rev()
        .take_while(|cost| {
            used = used.saturating_add(*cost);
            used <= budget
        })
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Turns of 400 bytes (137 tokens by the estimate): question and answer of messages
    /// 1..=n, then question n + 1.
    fn exchanges(n: i64) -> Vec<Turn> {
        let text = |c: char, i: i64| format!("{i}{}", c.to_string().repeat(399));
        let mut turns = Vec::new();
        for i in 1..=n + 1 {
            turns.push(Turn {
                message_id: i,
                message: ChatMessage::user(text('q', i)),
            });
            if i <= n {
                turns.push(Turn {
                    message_id: i,
                    message: ChatMessage::assistant(text('a', i)),
                });
            }
        }
        turns
    }

    fn ids(turns: &[Turn]) -> Vec<i64> {
        turns.iter().map(|t| t.message_id).collect()
    }

    #[test]
    fn the_older_exchanges_are_folded_until_the_newest_take_the_kept_share() {
        let turns = exchanges(4); // 9 turns, 1,233 tokens
        // Budget 700, half kept: 350 fit 2 turns, an answer first: only the question stays.
        let plan = split(&turns, 700, 50, None);
        assert_eq!(ids(plan.fold), [1, 1, 2, 2, 3, 3, 4, 4]);
        assert_eq!(ids(plan.recent), [5]);
        // Without the summary after all: the newest that fit the whole budget.
        assert_eq!(ids(plan.unfolded), [3, 3, 4, 4, 5]);
        // All kept: the newest that fit the budget, from a question on.
        let plan = split(&turns, 700, 100, None);
        assert_eq!(ids(plan.recent), [3, 3, 4, 4, 5]);
        assert_eq!(plan.fold.len(), 4);
        // The question alone over the budget stays, alone.
        let plan = split(&turns, 10, 50, None);
        assert_eq!(ids(plan.recent), [5]);
    }

    #[test]
    fn a_carried_summary_is_reused_while_the_turns_since_fit_beside_it() {
        let turns = exchanges(4);
        let carried = || Some(("short summary".to_string(), 3));
        // Since message 3: q4 a4 q5 = 411 tokens, and the summary's 20, fit 700.
        let plan = split(&turns, 700, 50, carried());
        assert!(plan.fold.is_empty());
        assert_eq!(ids(plan.recent), [4, 4, 5]);
        assert_eq!(plan.carried.unwrap().1, 3);
        // They do not fit 420 beside it: q4 and a4 are folded after the carried summary.
        let plan = split(&turns, 420, 50, carried());
        assert_eq!(ids(plan.fold), [4, 4]);
        assert_eq!(ids(plan.recent), [5]);
        assert!(plan.carried.is_some());
        // A summary older than every turn read: all of them are "since".
        let plan = split(&turns, 700, 50, Some(("old".to_string(), 0)));
        assert_eq!(plan.fold.len() + plan.recent.len(), turns.len());
    }

    #[test]
    fn a_summary_is_asked_of_the_newest_turns_that_fit_its_window() {
        let turns = exchanges(4);
        let all = summary_request(None, &turns[..8], usize::MAX);
        assert!(all.starts_with("Conversation so far:\nuser: 1q"));
        assert_eq!(all.lines().count(), 9);
        // 139 and 141 tokens a line: 420 less the head's 11 leaves two.
        let fitted = summary_request(None, &turns[..8], 420);
        assert_eq!(fitted.lines().count(), 3);
        assert!(fitted.contains("\nuser: 4q") && fitted.ends_with("a\n"));
        assert!(estimate_tokens(&fitted) <= 420);
        // The summary so far comes first and takes its room.
        let carried = summary_request(Some("the story so far"), &turns[..2], 420);
        assert!(carried.starts_with("Summary so far:\nthe story so far\n\nConversation since:\n"));
        assert_eq!(carried.lines().count(), 6);
        // The newest alone over the room: cut to fit, never sent whole.
        let one = [Turn {
            message_id: 1,
            message: ChatMessage::assistant(format!("answer {}", "长".repeat(10_000))),
        }];
        let cut = summary_request(None, &one, 1000);
        assert!(cut.contains("assistant: answer 长") && cut.len() < 3_000);
        assert!(estimate_tokens(&cut) <= 1000);
        assert_eq!(summary_request(None, &[], 1000), "Conversation so far:\n");
    }
}
