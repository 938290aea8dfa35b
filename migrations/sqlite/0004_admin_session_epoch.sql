-- Admin sessions carry the epoch they were signed in; signing out moves the epoch on, which
-- ends every session signed in before (the cookies themselves are stateless).
CREATE TABLE admin_state (
    name   TEXT   PRIMARY KEY,
    value  BIGINT NOT NULL
);
INSERT INTO admin_state (name, value) VALUES ('session_epoch', 0);
