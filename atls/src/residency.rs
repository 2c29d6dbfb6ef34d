//! Key residency: after the TLS handshake and before the connection is
//! handed to the application, every side that validated its peer proves that
//! the key which signed the peer's attestation document lives where the
//! document says it does.
//!
//! A document's signature only shows that *some* holder of the attestation
//! key signed it; a certified endorsement key next to it proves nothing by
//! itself, because anyone can copy a public EK certificate. So the validator
//! makes a [`Challenge`] (for a TPM: TPM2_MakeCredential to the certified EK
//! and the attestation key's name) and the peer's issuer answers it (for a
//! TPM: TPM2_ActivateCredential, which succeeds only in the TPM that holds
//! both keys). The answer never travels in the clear form: each side sends
//! `HMAC-SHA256(secret, context || role || exporter)`, where `exporter` is
//! keying material exported from this TLS session, so an answer is bound to
//! this connection and to the direction it proves.
//!
//! The exchange has three steps, each a frame sent by both sides:
//!
//! 1. `challenge`: this side's challenge for the peer, or empty when it does
//!    not validate the peer or its validator has already seen this key proven;
//! 2. `answer`: the proof for the peer's challenge, or empty when there was
//!    none; or, in its place, `busy`: this side would answer but answers no
//!    more challenges for a while (its answer rate, `rate`), so the peer may
//!    try again later rather than take it for a forger;
//! 3. `verdict`: whether the peer's answer checked out.
//!
//! Each side sends its frame of a step before it reads the peer's, but for
//! one: a server that challenged its client reads the client's answer, and
//! checks it, before it answers (an empty answer if the client's was not
//! right), so that only a client that proved its own key costs the
//! server's TPM a decryption. The client always answers first, so no order
//! deadlocks, and a client of either kind works with a server of either.
//!
//! A side that sent an empty challenge already knows its verdict (it accepts
//! only an empty answer), so it sends the verdict right behind its answer:
//! one round trip fewer when neither side challenges, as between peers that
//! know each other, with the frames and their order unchanged.
//!
//! A frame is `tag (1) || u16be(len) || body`, the body at most
//! [`MAX_FRAME_BODY`] bytes. `busy` is a frame of its own tag with an empty
//! body, sent only where a challenge came: a peer from before it (which
//! reads only an answer there) ends the exchange with
//! [`ResidencyError::Frame`], a malformed frame, where it used to see an
//! empty answer ([`ResidencyError::NoAnswer`], which reads as a forged
//! node); every other exchange is unchanged on the wire.

use std::io;
use std::sync::Arc;

use ring::hmac;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::attestation::{
    Challenge, DynIssuer, DynValidator, IssueError, ResidencySecret, ValidationError,
};
use crate::incoming::{IssuerGate, ServerWork, Source};

/// Largest frame body: a TPM credential challenge is about 330 bytes.
pub(crate) const MAX_FRAME_BODY: usize = 2048;
/// Label of the TLS exporter the proofs are bound to (RFC 8446, 7.5).
const EXPORTER_LABEL: &[u8] = b"EXPORTER-keel-atls-key-residency";
/// Domain separation of the proof.
const PROOF_CONTEXT: &[u8] = b"keel-atls-residency-v1";

const TAG_CHALLENGE: u8 = 0x21;
const TAG_ANSWER: u8 = 0x22;
const TAG_VERDICT: u8 = 0x23;
/// In place of an answer: busy, try again later (an empty body).
const TAG_BUSY: u8 = 0x24;
const VERDICT_ACCEPTED: u8 = 0x01;
const VERDICT_REFUSED: u8 = 0x00;

/// Which end of the connection this side is; the proof names the prover.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    Server,
    Client,
}

impl Role {
    fn label(self) -> &'static [u8] {
        match self {
            Self::Server => b"server",
            Self::Client => b"client",
        }
    }

    fn peer(self) -> Self {
        match self {
            Self::Server => Self::Client,
            Self::Client => Self::Server,
        }
    }
}

/// Why the residency exchange failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ResidencyError {
    /// Exporting keying material from the TLS session failed.
    #[error("exporting TLS keying material failed")]
    Exporter(#[source] rustls::Error),
    /// Reading or writing a frame failed.
    #[error("the key residency exchange failed on the connection")]
    Io(#[source] io::Error),
    /// The peer closed the connection during the exchange, typically because
    /// it refused this side; its log has the reason.
    #[error("the peer closed the connection during the key residency exchange; the peer's log has the reason")]
    Closed,
    /// The peer sent a frame of the wrong kind or size.
    #[error("the peer sent a malformed key residency frame")]
    Frame,
    /// This side's validator could not make a challenge.
    #[error("making the key residency challenge failed")]
    Challenge(#[source] ValidationError),
    /// The peer challenged this side, which does not attest.
    #[error("the peer sent a key residency challenge, but this side does not attest")]
    UnexpectedChallenge,
    /// This side could not answer the peer's challenge: its key is not the
    /// one the challenge was made for, or its TPM failed.
    #[error("answering the peer's key residency challenge failed")]
    Answer(#[source] IssueError),
    /// The queue for the issuer was closed (never expected).
    #[error("the issuer queue is closed")]
    IssuerGateClosed,
    /// This side's TPM answered as many challenges from the peer's address
    /// (or, on a port that validates no client, from all addresses) as it
    /// does for a while (`rate`); the peer was told this side is busy.
    #[error(
        "too many key residency challenges answered lately; the peer was told to try again later"
    )]
    AnswerRate,
    /// The blocking task that answers the challenge did not finish.
    #[error("the key residency answer task failed")]
    Task(#[source] tokio::task::JoinError),
    /// The peer did not answer this side's challenge.
    #[error("the peer did not answer the key residency challenge: its attestation key is not proven to be in the TPM of its endorsement key")]
    NoAnswer,
    /// The peer would answer this side's challenge, but answers no more for
    /// a while: it answered as many as it does lately (its answer rate).
    /// Worth trying again after a pause; it says nothing against the
    /// peer's attestation key.
    #[error("the peer is busy: it answers no more key residency challenges for a while (too many asked of it lately); try again shortly. This says nothing against its attestation")]
    Busy,
    /// The peer's answer is wrong.
    #[error("the peer's key residency proof is wrong: its attestation key is not in the TPM of its endorsement key")]
    WrongAnswer,
    /// The peer refused this side's answer; its log has the reason.
    #[error("the peer refused this side's key residency proof; the peer's log has the reason")]
    RefusedByPeer,
}

/// What answers the peer's challenge: this side's issuer and, on a server,
/// the gate that bounds how many handshakes per source use it at once (an
/// answer is a TPM operation, like a quote), and the handshake's account
/// of the server's own work, which the answer is.
pub(crate) struct Prover {
    pub(crate) issuer: DynIssuer,
    pub(crate) gate: Option<(Arc<IssuerGate>, Source)>,
    pub(crate) work: ServerWork,
}

/// What this side checks of its peer: its validator and what it established.
pub(crate) struct PeerKey<'a, C> {
    pub(crate) validator: &'a DynValidator<C>,
    pub(crate) claims: &'a C,
}

/// Exports this session's keying material for the proofs.
pub(crate) fn export<D>(conn: &rustls::ConnectionCommon<D>) -> Result<[u8; 32], ResidencyError> {
    conn.export_keying_material([0u8; 32], EXPORTER_LABEL, None)
        .map_err(ResidencyError::Exporter)
}

/// Runs the exchange on an established connection. `prover` answers the
/// peer's challenge (this side's issuer, if it attests); `peer` is checked
/// when this side validated the peer.
pub(crate) async fn exchange<S, C>(
    stream: &mut S,
    exporter: &[u8; 32],
    role: Role,
    prover: Option<Prover>,
    peer: Option<PeerKey<'_, C>>,
) -> Result<(), ResidencyError>
where
    S: AsyncRead + AsyncWrite + Unpin,
    C: Send + Sync + 'static,
{
    // 1. Challenges both ways.
    let challenge: Option<Challenge> = match &peer {
        Some(p) => p
            .validator
            .residency_challenge(p.claims)
            .map_err(ResidencyError::Challenge)?,
        None => None,
    };
    let sent = challenge.as_ref().map(Challenge::message).unwrap_or(&[]);
    // A peer this side validated is an attested node (its key proven now,
    // below, or before); any other may be anyone.
    let waiter = if peer.is_some() {
        Waiter::Attested
    } else {
        Waiter::Anyone
    };
    write_frame(stream, TAG_CHALLENGE, sent).await?;
    let received = read_frame(stream, TAG_CHALLENGE).await?;

    // 2. Answers both ways. A side that cannot answer sends an empty proof
    // and goes on, so the peer reaches its verdict and logs the reason. A
    // server that challenged its client answers only once the client's
    // proof checked out: a forger (a copied EK certificate, a software AK)
    // gets nothing from this TPM, whose every answer is an EK decryption.
    // The client answers first either way, so no order can deadlock.
    let judge = |peer_answer: Answer| match (&challenge, peer_answer) {
        (None, Answer::Proof(proof)) if proof.is_empty() => Ok(()),
        (None, _) => Err(ResidencyError::Frame),
        (Some(_), Answer::Busy) => Err(ResidencyError::Busy),
        (Some(_), Answer::Proof(proof)) if proof.is_empty() => Err(ResidencyError::NoAnswer),
        (Some(c), Answer::Proof(proof)) => {
            let key = hmac::Key::new(hmac::HMAC_SHA256, c.secret());
            hmac::verify(&key, &proof_message(role.peer(), exporter), &proof)
                .map_err(|_| ResidencyError::WrongAnswer)
        }
    };
    let (outcome, cannot_answer) = if role == Role::Server && challenge.is_some() {
        let outcome = judge(read_answer(stream).await?);
        let (answer, cannot_answer) = match &outcome {
            Ok(()) => prove(prover, received, role, exporter, waiter).await,
            Err(_) => (Answer::none(), None),
        };
        send(stream, &answer.frame()?).await?;
        (outcome, cannot_answer)
    } else {
        let (answer, cannot_answer) = prove(prover, received, role, exporter, waiter).await;
        let mut frames = answer.frame()?;
        if challenge.is_none() {
            // Whatever the peer answers, this side accepts only nothing: an
            // answer where none was asked for ends the exchange with an
            // error below, and the connection with it.
            frames.extend(frame(TAG_VERDICT, &[VERDICT_ACCEPTED])?);
        }
        send(stream, &frames).await?;
        (judge(read_answer(stream).await?), cannot_answer)
    };

    // 3. Verdicts both ways.
    if challenge.is_some() {
        let verdict = if outcome.is_ok() {
            VERDICT_ACCEPTED
        } else {
            VERDICT_REFUSED
        };
        write_frame(stream, TAG_VERDICT, &[verdict]).await?;
    }
    outcome?;
    if let (Some(_), Some(p)) = (&challenge, &peer) {
        p.validator.residency_proven(p.claims);
    }
    // Why this side could not answer comes first: a peer that had no
    // answer may close without its verdict.
    let peer_verdict = read_frame(stream, TAG_VERDICT).await;
    if let Some(e) = cannot_answer {
        return Err(e);
    }
    match peer_verdict?.as_slice() {
        [VERDICT_ACCEPTED] => Ok(()),
        [VERDICT_REFUSED] => Err(ResidencyError::RefusedByPeer),
        _ => Err(ResidencyError::Frame),
    }
}

/// What a side sends in the answer step.
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    /// The proof for the peer's challenge; empty when there was none or
    /// this side could not answer.
    Proof(Vec<u8>),
    /// Busy: this side answers no more challenges for a while.
    Busy,
}

impl Answer {
    fn none() -> Self {
        Self::Proof(Vec::new())
    }

    fn frame(&self) -> Result<Vec<u8>, ResidencyError> {
        match self {
            Self::Proof(proof) => frame(TAG_ANSWER, proof),
            Self::Busy => frame(TAG_BUSY, &[]),
        }
    }
}

/// This side's answer to the peer's challenge `received` (an empty proof if
/// there was none), and why it could not answer, if it could not.
async fn prove(
    prover: Option<Prover>,
    received: Vec<u8>,
    role: Role,
    exporter: &[u8; 32],
    waiter: Waiter,
) -> (Answer, Option<ResidencyError>) {
    if received.is_empty() {
        return (Answer::none(), None);
    }
    match prover {
        None => (Answer::none(), Some(ResidencyError::UnexpectedChallenge)),
        Some(prover) => match answer(prover, received, waiter).await {
            Ok(secret) => (
                Answer::Proof(proof(&secret, role, exporter).as_ref().to_vec()),
                None,
            ),
            Err(e @ ResidencyError::AnswerRate) => (Answer::Busy, Some(e)),
            Err(e) => (Answer::none(), Some(e)),
        },
    }
}

/// Who waits for an answer, as a server's eviction sees its wait.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Waiter {
    /// A client this server validated (a mutual port; a server that
    /// challenged it answers only once its proof checked out): only
    /// attested nodes wait here, so the wait in the shared queue is the
    /// server's work, and a control plane's members reconnecting at once
    /// are not closed while they queue for their answers. The gate
    /// shelters one such wait per source and as many in all as the
    /// issuer takes at once; the others, and the wait for the source's
    /// share, age: a node of an accepted image, compromised, cannot
    /// shelter its handshakes from one address or from many.
    Attested,
    /// Anyone (a port that validates no client): the wait for a turn at
    /// the issuer ages the handshake, where a flood's own queue must not
    /// shelter it.
    Anyone,
}

/// Runs the issuer's answer on a blocking thread (it may talk to a TPM).
/// The handshake's time here is the server's work ([`ServerWork`]) but for
/// the wait for a turn at the issuer: all of it for a client anyone could
/// be, for an attested one the wait for its source's share and a shared
/// queue wait past the gate's shelter.
async fn answer(
    prover: Prover,
    challenge: Vec<u8>,
    waiter: Waiter,
) -> Result<ResidencySecret, ResidencyError> {
    let turn = match &prover.gate {
        Some((gate, source)) => {
            // At most QUIET_WAIT, one request waiting per prefix.
            let rate = prover.work.begin();
            if !gate.may_answer(*source).await {
                return Err(ResidencyError::AnswerRate);
            }
            drop(rate);
            let shared_wait = (waiter == Waiter::Attested).then_some(&prover.work);
            let turn = gate
                .enter_counting(*source, shared_wait)
                .await
                .map_err(|_| ResidencyError::IssuerGateClosed)?;
            Some(turn)
        }
        None => None,
    };
    let _own_work = prover.work.begin();
    let issuer = prover.issuer;
    tokio::task::spawn_blocking(move || {
        // Held until the issuer returns, also if the handshake gave up.
        let _turn = turn;
        issuer.answer(&challenge)
    })
    .await
    .map_err(ResidencyError::Task)?
    .map_err(ResidencyError::Answer)
}

fn proof_message(prover: Role, exporter: &[u8; 32]) -> Vec<u8> {
    [PROOF_CONTEXT, prover.label(), exporter.as_slice()].concat()
}

fn proof(secret: &ResidencySecret, prover: Role, exporter: &[u8; 32]) -> hmac::Tag {
    let key = hmac::Key::new(hmac::HMAC_SHA256, secret.as_slice());
    hmac::sign(&key, &proof_message(prover, exporter))
}

/// The frame `tag || u16be(len) || body`.
fn frame(tag: u8, body: &[u8]) -> Result<Vec<u8>, ResidencyError> {
    let len = u16::try_from(body.len())
        .ok()
        .filter(|&l| usize::from(l) <= MAX_FRAME_BODY)
        .ok_or(ResidencyError::Frame)?;
    let mut frame = Vec::with_capacity(3 + body.len());
    frame.push(tag);
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(body);
    Ok(frame)
}

async fn write_frame<S: AsyncWrite + Unpin>(
    stream: &mut S,
    tag: u8,
    body: &[u8],
) -> Result<(), ResidencyError> {
    send(stream, &frame(tag, body)?).await
}

/// Writes `frames` in one go and flushes them.
async fn send<S: AsyncWrite + Unpin>(stream: &mut S, frames: &[u8]) -> Result<(), ResidencyError> {
    stream.write_all(frames).await.map_err(io_error)?;
    stream.flush().await.map_err(io_error)
}

async fn read_frame<S: AsyncRead + Unpin>(
    stream: &mut S,
    want: u8,
) -> Result<Vec<u8>, ResidencyError> {
    read_frame_of(stream, |tag, _| tag == want)
        .await
        .map(|(_, body)| body)
}

/// Reads the peer's answer: a proof (maybe empty) or busy.
async fn read_answer<S: AsyncRead + Unpin>(stream: &mut S) -> Result<Answer, ResidencyError> {
    let busy_or_answer = |tag, len| tag == TAG_ANSWER || (tag == TAG_BUSY && len == 0);
    match read_frame_of(stream, busy_or_answer).await? {
        (TAG_BUSY, _) => Ok(Answer::Busy),
        (_, proof) => Ok(Answer::Proof(proof)),
    }
}

/// Reads a frame whose tag and length `expected` accepts (the body is read
/// only then), and returns its tag and body.
async fn read_frame_of<S: AsyncRead + Unpin>(
    stream: &mut S,
    expected: impl Fn(u8, usize) -> bool,
) -> Result<(u8, Vec<u8>), ResidencyError> {
    let mut head = [0u8; 3];
    stream.read_exact(&mut head).await.map_err(io_error)?;
    let [tag, hi, lo] = head;
    let len = usize::from(u16::from_be_bytes([hi, lo]));
    if !expected(tag, len) || len > MAX_FRAME_BODY {
        return Err(ResidencyError::Frame);
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).await.map_err(io_error)?;
    Ok((tag, body))
}

fn io_error(e: io::Error) -> ResidencyError {
    match e.kind() {
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::BrokenPipe => ResidencyError::Closed,
        _ => ResidencyError::Io(e),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn proofs_name_their_direction() {
        let secret: ResidencySecret = zeroize::Zeroizing::new([7u8; 32]);
        let exporter = [1u8; 32];
        let server = proof(&secret, Role::Server, &exporter);
        let client = proof(&secret, Role::Client, &exporter);
        assert_ne!(server.as_ref(), client.as_ref());
        let other_session = proof(&secret, Role::Server, &[2u8; 32]);
        assert_ne!(server.as_ref(), other_session.as_ref());
    }

    /// A side that neither challenges nor is challenged: `exchange` against
    /// a peer scripted frame by frame, as a peer that sends its verdict
    /// only after reading the answer does. The peer sends `peer_answer`.
    async fn unchallenged_exchange(peer_answer: &[u8]) -> (Result<(), ResidencyError>, Vec<u8>) {
        let (mut ours, mut theirs) = tokio::io::duplex(4096);
        let exchange = exchange::<_, ()>(&mut ours, &[0; 32], Role::Server, None, None);
        let peer_answer = peer_answer.to_vec();
        let peer = async move {
            let mut seen = Vec::new();
            for (tag, body) in [
                (TAG_CHALLENGE, Vec::new()),
                (TAG_ANSWER, peer_answer),
                (TAG_VERDICT, vec![VERDICT_ACCEPTED]),
            ] {
                write_frame(&mut theirs, tag, &body).await.unwrap();
                let Ok(received) = read_frame(&mut theirs, tag).await else {
                    break;
                };
                seen.extend([tag, 0, u8::try_from(received.len()).unwrap()]);
                seen.extend(received);
            }
            seen
        };
        tokio::join!(exchange, peer)
    }

    #[tokio::test]
    async fn without_challenges_the_frames_and_their_order_are_unchanged() {
        let (outcome, seen) = unchallenged_exchange(&[]).await;
        outcome.unwrap();
        assert_eq!(
            seen,
            [
                TAG_CHALLENGE,
                0,
                0,
                TAG_ANSWER,
                0,
                0,
                TAG_VERDICT,
                0,
                1,
                VERDICT_ACCEPTED
            ]
        );
    }

    #[tokio::test]
    async fn an_answer_nobody_asked_for_ends_the_exchange() {
        let (outcome, _) = unchallenged_exchange(&[7; 32]).await;
        assert!(matches!(outcome, Err(ResidencyError::Frame)), "{outcome:?}");
    }

    /// Challenges with a fixed secret, and answers it.
    struct Fixed;

    const SECRET: [u8; 32] = [9; 32];

    impl crate::Validator for Fixed {
        type Claims = ();

        fn validate(&self, _: &[u8], _: &[u8], _: &[u8]) -> Result<(), ValidationError> {
            Ok(())
        }

        fn residency_challenge(&self, _: &()) -> Result<Option<Challenge>, ValidationError> {
            Ok(Some(Challenge::new(
                vec![1; 32],
                zeroize::Zeroizing::new(SECRET),
            )))
        }

        fn residency_proven(&self, _: &()) {}
    }

    impl crate::Issuer for Fixed {
        fn issue(&self, _: &[u8], _: &[u8]) -> Result<Vec<u8>, IssueError> {
            Ok(Vec::new())
        }

        fn answer(&self, _: &[u8]) -> Result<ResidencySecret, IssueError> {
            Ok(zeroize::Zeroizing::new(SECRET))
        }
    }

    /// A server's prover that has answered as many challenges as it does
    /// for a while.
    async fn spent_prover() -> Prover {
        let gate = Arc::new(IssuerGate::new(1, 1, false));
        while gate.may_answer(Source::Unknown).await {}
        Prover {
            issuer: Arc::new(Fixed),
            gate: Some((gate, Source::Unknown)),
            work: ServerWork::default(),
        }
    }

    /// Busy is reported as busy, never as a missing or wrong answer: on a
    /// client that does not attest, and on one that attests and whose
    /// own answer the server checked first.
    #[tokio::test]
    async fn a_server_past_its_answer_rate_is_reported_busy() {
        let validator: DynValidator<()> = Arc::new(Fixed);
        for client_attests in [false, true] {
            let (mut client_io, mut server_io) = tokio::io::duplex(4096);
            let peer = || {
                Some(PeerKey {
                    validator: &validator,
                    claims: &(),
                })
            };
            let client_prover = client_attests.then(|| Prover {
                issuer: Arc::new(Fixed),
                gate: None,
                work: ServerWork::default(),
            });
            let server_peer = if client_attests { peer() } else { None };
            let client = exchange(
                &mut client_io,
                &[0; 32],
                Role::Client,
                client_prover,
                peer(),
            );
            let server = exchange(
                &mut server_io,
                &[0; 32],
                Role::Server,
                Some(spent_prover().await),
                server_peer,
            );
            let (client, server) = tokio::join!(client, server);
            assert!(matches!(client, Err(ResidencyError::Busy)), "{client:?}");
            assert!(
                matches!(server, Err(ResidencyError::AnswerRate)),
                "{server:?}"
            );
        }
    }

    /// What a client from before the busy frame sees where it comes: a
    /// frame of another tag than the answer it reads, so a malformed
    /// frame, not a missing answer (which reads as a forged node). The
    /// server still reports why it did not answer.
    #[tokio::test]
    async fn a_client_from_before_busy_reads_a_malformed_frame() {
        let (mut old, mut server_io) = tokio::io::duplex(4096);
        let server = exchange::<_, ()>(
            &mut server_io,
            &[0; 32],
            Role::Server,
            Some(spent_prover().await),
            None,
        );
        let old_client = async move {
            write_frame(&mut old, TAG_CHALLENGE, &[1; 32])
                .await
                .unwrap();
            read_frame(&mut old, TAG_CHALLENGE).await.unwrap();
            write_frame(&mut old, TAG_ANSWER, &[]).await.unwrap();
            // The previous version reads the answer so, and then closes.
            read_frame(&mut old, TAG_ANSWER).await
        };
        let (server, old) = tokio::join!(server, old_client);
        assert!(matches!(old, Err(ResidencyError::Frame)), "{old:?}");
        assert!(
            matches!(server, Err(ResidencyError::AnswerRate)),
            "{server:?}"
        );
    }

    #[tokio::test]
    async fn oversized_frames_are_refused_before_reading_the_body() {
        let (mut a, mut b) = tokio::io::duplex(64);
        let len = u16::try_from(MAX_FRAME_BODY + 1).unwrap();
        let mut head = vec![TAG_CHALLENGE];
        head.extend_from_slice(&len.to_be_bytes());
        a.write_all(&head).await.unwrap();
        assert!(matches!(
            read_frame(&mut b, TAG_CHALLENGE).await,
            Err(ResidencyError::Frame)
        ));
    }
}
